"""SGLang's load reports: GET /v1/loads and the older GET /get_load.

    /v1/loads?include=core,...&dp_rank=0&format=json|prometheus
        (sglang/srt/entrypoints/v1_loads.py) ->
        {"timestamp": ISO 8601, "version", "dp_rank_count": 1,
         "loads": [{"dp_rank": 0, "num_running_reqs", "num_waiting_reqs", "num_total_reqs",
                    "num_used_tokens", "max_total_num_tokens", "token_usage",
                    "cache_hit_rate", "max_running_requests"}],
         "aggregate": {"total_running_reqs", "total_waiting_reqs", "total_reqs", "avg_token_usage"}}
        One engine replica: dp_rank 0. Fields Trillium does not measure
        (gen_throughput, utilization, the memory / spec / lora / disagg / queues
        sections) are absent, as SGLang leaves out what it has no value for.
        An include section SGLang does not know, another dp_rank or format is a 400.
    /get_load -> [{"dp_rank": 0, "num_reqs", "num_waiting_reqs", "num_tokens", "ts_tic"}]

From the engine's latest SchedulerStats (zeros before the first step).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

from quart import Blueprint, Response, request

from trillium.control_plane.errors import bad_request
from trillium.control_plane.responses import json_response
from trillium.control_plane.query import takes_query
from trillium.control_plane.state import AdminState

SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
_PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("loads", __name__)
    engine = state.engine

    def load() -> dict:
        stats, config = engine.client.last_stats, engine.engine_config
        running = stats.num_running if stats else 0
        waiting = stats.num_waiting if stats else 0
        free = stats.num_free_blocks if stats else config.num_blocks
        queries = stats.prefix_cache_queries_total if stats else 0
        return {
            "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_used_tokens": (config.num_blocks - free) * config.block_size,
            "max_total_num_tokens": config.num_blocks * config.block_size,
            "token_usage": stats.kv_usage if stats else 0.0,
            "cache_hit_rate": (stats.prefix_cache_hits_total / queries) if queries else 0.0,
            "max_running_requests": config.max_num_seqs,
        }

    @bp.get("/v1/loads")
    @takes_query("include", "dp_rank", "format")
    async def loads():
        include = [s.strip() for s in request.args.get("include", "").split(",") if s.strip()]
        unknown = sorted(set(include) - SECTIONS)
        if unknown:
            raise bad_request(f"include: invalid sections {unknown}; valid: {sorted(SECTIONS)}", "include")
        if request.args.get("dp_rank", "0") != "0":
            raise bad_request("dp_rank: this server has one engine replica, dp_rank 0", "dp_rank")
        fmt = request.args.get("format", "json")
        if fmt not in ("json", "prometheus"):
            raise bad_request(f"format: expected json or prometheus, got {fmt!r}", "format")
        one = load()
        if fmt == "prometheus":
            lines = [f'sglang_{name}{{dp_rank="0"}} {value}' for name, value in one.items() if name != "dp_rank"]
            return Response("\n".join(lines) + "\n", status=200, content_type=_PROMETHEUS)
        one["num_total_reqs"] = one["num_running_reqs"] + one["num_waiting_reqs"]
        return json_response({
            "timestamp": datetime.now(timezone.utc).isoformat(), "version": engine.version, "dp_rank_count": 1,
            "loads": [one],
            "aggregate": {"total_running_reqs": one["num_running_reqs"],
                          "total_waiting_reqs": one["num_waiting_reqs"], "total_reqs": one["num_total_reqs"],
                          "avg_token_usage": round(one["token_usage"], 4)},
        })

    @bp.get("/get_load")
    async def get_load():
        one = load()
        return json_response([{"dp_rank": 0, "num_reqs": one["num_running_reqs"] + one["num_waiting_reqs"],
                               "num_waiting_reqs": one["num_waiting_reqs"], "num_tokens": one["num_used_tokens"],
                               "ts_tic": time.perf_counter()}])

    return bp
