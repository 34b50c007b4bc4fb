"""Configuration and live state: GET /server_info, SGLang's /get_server_info and /get_model_info.

    /server_info, /get_server_info
        {"version", "served_model_name", "model_path", "engine_config": {...},
         "engine_state", "is_sleeping", "is_paused", "weight_version",
         "kv_cache_usage", "num_free_blocks", "num_running", "num_waiting", "step_id",
         "actors": {name: {"pid", "alive"}}, "api_pid",
         "allowed_weight_paths", "profile_dir", "profiling",
         "engine_info": {...} | null,
         "tp_ranks": [{"rank", "node", "local", "actor", "pid", "alive"}],
         "replicas": [{"replica", "serving", "failure", "engine_state", "weight_version",
                       "num_running", "num_waiting", "kv_cache_usage", "device", ...}]}
        (one per --data-parallel-size replica, with its routed-request count under DP;
        "actors" names them "<actor>@<replica>" then)
        /get_server_info adds the names SGLang's server args and scheduler
        info use for the same facts ("tp_size", "dp_size", "context_length",
        "page_size", "max_total_num_tokens", "max_running_requests",
        "internal_states": [engine_info]).
    /get_model_info
        {"model_path", "tokenizer_path", "is_generation": true,
         "preferred_sampling_params": null, "weight_version",
         "has_image_understanding": false, "has_audio_understanding": false}

`engine_info` is the engine's own answer to GetEngineInfo, null when it
does not answer within a few seconds (a weight load in progress).

`tp_ranks` lists every tensor-parallel rank of the engine (one without TP),
with the node that runs it (`--nnodes`: rank r on node r // (N / nnodes),
distributed/nodes.py). This host's ranks carry their actor name, pid and
liveness; another host's (`--headless` there) have `"local": false` and null
pid / alive: nothing here polls them. NOTE: a remote rank that dies or hangs
still stops the engine (its next collective fails or times out:
--tp-collective-timeout-s), so `/health` and `engine_state` say so.
"""

from __future__ import annotations

import os

import attrs
from quart import Blueprint

from trillium.actors.protocol.admin import GetEngineInfo
from trillium.control_plane.responses import json_response
from trillium.control_plane.state import AdminState, new_command_id

_ENGINE_INFO_TIMEOUT_S = 5.0


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("server_info", __name__)
    engine = state.engine

    async def info() -> dict:
        reply = await state.command(GetEngineInfo(new_command_id()), timeout_s=_ENGINE_INFO_TIMEOUT_S)
        stats = engine.client.last_stats
        _, alive = state.healthy()
        alive = alive if isinstance(alive, dict) else {}
        config = engine.engine_config
        actors = {name: {"pid": pid, "alive": bool(alive.get(name, False))}
                  for name, pid in engine.actor_pids().items()}
        return {
            "version": engine.version,
            "served_model_name": config.served_model_name,
            "model_path": config.model,
            "engine_config": attrs.asdict(config),
            "engine_state": state.status.engine_state,
            "is_sleeping": state.status.is_sleeping,
            "is_paused": state.status.is_paused,
            "weight_version": state.status.weight_version,
            "kv_cache_usage": stats.kv_usage if stats else 0.0,
            "num_free_blocks": stats.num_free_blocks if stats else config.num_blocks,
            "num_running": stats.num_running if stats else 0,
            "num_waiting": stats.num_waiting if stats else 0,
            "step_id": stats.step_id if stats else 0,
            "actors": actors,
            "api_pid": os.getpid(),
            "allowed_weight_paths": list(engine.weight_paths.roots),
            "profile_dir": engine.profile_dir,
            "profiling": state.profiling,
            "engine_info": dict(reply.data) if reply.ok else None,
            "replicas": _replicas(engine, stats),
            "tp_ranks": _tp_ranks(config, actors),
        }

    @bp.get("/server_info")
    async def server_info():
        return json_response(await info())

    @bp.get("/get_server_info")
    async def get_server_info():
        out = await info()
        config = engine.engine_config
        return json_response({
            **out, "tp_size": config.tensor_parallel_size, "dp_size": 1, "context_length": config.max_model_len,
            "page_size": config.block_size, "max_total_num_tokens": config.num_blocks * config.block_size,
            "max_running_requests": config.max_num_seqs,
            "internal_states": [out["engine_info"]] if out["engine_info"] is not None else [],
        } | {"dp_size": len(out["replicas"])})

    @bp.get("/get_model_info")
    async def get_model_info():
        config = engine.engine_config
        return json_response({
            "model_path": config.model, "tokenizer_path": config.model, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": state.status.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False,
        })

    return bp


def _tp_ranks(config, actors: dict[str, dict]) -> list[dict]:
    """Every rank of the tensor-parallel group and its node; this host's (node 0's) with pid and liveness."""
    size, nnodes = config.tensor_parallel_size, config.tp_nnodes
    out = []
    for rank in range(size):
        node = rank // (size // nnodes)
        name = "executor" if rank == 0 else f"executor-rank{rank}"
        local = actors.get(name) if node == 0 else None
        out.append({"rank": rank, "node": node, "local": node == 0, "actor": name if node == 0 else None,
                    "pid": local["pid"] if local else None, "alive": local["alive"] if local else None})
    return out


def _replicas(engine, stats) -> list[dict]:
    """The engine replicas (`--data-parallel-size`; data_parallel/client.py `replica_info`), one without."""
    replica_info = getattr(engine.client, "replica_info", None)
    if replica_info is not None:
        return replica_info()
    return [{"replica": 0, "serving": True, "failure": None,
             "engine_state": str(stats.engine_state) if stats else "serving",
             "weight_version": stats.weight_version if stats else "0",
             "num_running": stats.num_running if stats else 0, "num_waiting": stats.num_waiting if stats else 0,
             "kv_cache_usage": stats.kv_usage if stats else 0.0, "device": engine.engine_config.device}]
