"""SGLang's load reports: GET /v1/loads and the older GET /get_load.

    /v1/loads?include=core,...&dp_rank=0&format=json|prometheus
        (sglang/srt/entrypoints/v1_loads.py) ->
        {"timestamp": ISO 8601, "version", "dp_rank_count": 1,
         "loads": [{"dp_rank": 0, "num_running_reqs", "num_waiting_reqs", "num_total_reqs",
                    "num_used_tokens", "max_total_num_tokens", "token_usage",
                    "cache_hit_rate", "max_running_requests"}],
         "aggregate": {"total_running_reqs", "total_waiting_reqs", "total_reqs", "avg_token_usage"}}
        One entry per engine replica (dp_rank i: --data-parallel-size replica i; without
        the flag, dp_rank 0); dp_rank=i keeps replica i only, and the aggregate sums what is
        listed. Fields Trillium does not measure
        (gen_throughput, utilization, the memory / spec / lora / disagg / queues
        sections) are absent, as SGLang leaves out what it has no value for.
        An include section SGLang does not know, a dp_rank the server lacks or another format is a 400.
    /get_load -> [{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "ts_tic"}], one per replica

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

    def replica_stats() -> list:
        """Each engine replica's latest stats (--data-parallel-size: one per dp_rank)."""
        replicas = getattr(engine.client, "replicas", None)
        return [client.last_stats for client in replicas] if replicas else [engine.client.last_stats]

    def load(rank: int = 0, stats=None) -> dict:
        config = engine.engine_config
        running = stats.num_running if stats else 0
        waiting = stats.num_waiting if stats else 0
        free = stats.num_free_blocks if stats else config.num_blocks
        queries = stats.prefix_cache_queries_total if stats else 0
        return {
            "dp_rank": rank, "num_running_reqs": running, "num_waiting_reqs": waiting,
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
        every = [load(rank, stats) for rank, stats in enumerate(replica_stats())]
        ranks = [str(one["dp_rank"]) for one in every]
        dp_rank = request.args.get("dp_rank")
        if dp_rank is not None and dp_rank not in ranks:
            raise bad_request(f"dp_rank: this server's engine replicas are dp_rank {', '.join(ranks)}", "dp_rank")
        fmt = request.args.get("format", "json")
        if fmt not in ("json", "prometheus"):
            raise bad_request(f"format: expected json or prometheus, got {fmt!r}", "format")
        chosen = [one for one in every if dp_rank is None or str(one["dp_rank"]) == dp_rank]
        if fmt == "prometheus":
            lines = [f'sglang_{name}{{dp_rank="{one["dp_rank"]}"}} {value}' for one in chosen
                     for name, value in one.items() if name != "dp_rank"]
            return Response("\n".join(lines) + "\n", status=200, content_type=_PROMETHEUS)
        for one in chosen:
            one["num_total_reqs"] = one["num_running_reqs"] + one["num_waiting_reqs"]
        return json_response({
            "timestamp": datetime.now(timezone.utc).isoformat(), "version": engine.version,
            "dp_rank_count": len(every), "loads": chosen,
            "aggregate": {"total_running_reqs": sum(one["num_running_reqs"] for one in chosen),
                          "total_waiting_reqs": sum(one["num_waiting_reqs"] for one in chosen),
                          "total_reqs": sum(one["num_total_reqs"] for one in chosen),
                          "avg_token_usage": round(sum(one["token_usage"] for one in chosen) / len(chosen), 4)},
        })

    @bp.get("/get_load")
    async def get_load():
        return json_response([{"dp_rank": one["dp_rank"], "num_reqs": one["num_running_reqs"] + one["num_waiting_reqs"],
                               "num_waiting_reqs": one["num_waiting_reqs"], "num_tokens": one["num_used_tokens"],
                               "ts_tic": time.perf_counter()}
                              for one in (load(rank, stats) for rank, stats in enumerate(replica_stats()))])

    return bp
