"""Sleep and wake: vLLM's /sleep, /wake_up, /is_sleeping and SGLang's memory-occupation routes.

    /sleep    {"level": 1 | 2, "mode": "abort" | "wait" | "keep" | "retract"}  or ?level=2&mode=abort
              level 1: weights to host memory, KV cache freed; level 2: both freed.
              mode: what happens to requests in flight (default abort).
    /wake_up  {"tags": ["weights", "kv_cache"]}  or ?tags=weights&tags=kv_cache   (default: both)
    /is_sleeping -> {"is_sleeping": bool}

    /release_memory_occupation {"tags": ["weights" | "kv_cache"] | null}   (SGLang)
        null or both: a level-1 sleep. One tag: a level-1 sleep, then a wake
        of the other tag, so only the named memory is released.
    /resume_memory_occupation  {"tags": [...] | null}: a wake of those tags (null: all).
        SGLang's "cuda_graph" tag is a 400 naming it: Trillium captures no CUDA graphs.

While the sleep command runs and after it, the data plane answers 503 +
Retry-After. A partial wake (one tag) leaves the engine sleeping.
"""

from __future__ import annotations

from quart import Blueprint, request

from trillium.actors.protocol.admin import Sleep, WakeUp
from trillium.actors.protocol.vocabulary import ALL_WAKE_TAGS, EngineState, PauseMode, WakeTag
from trillium.control_plane.errors import bad_request
from trillium.control_plane.protocol import MemoryOccupationRequest, SleepRequest, WakeUpRequest, parse_body
from trillium.control_plane.query import takes_query, with_query
from trillium.control_plane.responses import json_response, success
from trillium.control_plane.state import AdminState, new_command_id


def _memory_tags(req: MemoryOccupationRequest) -> tuple[WakeTag, ...]:
    if not req.tags:
        return ALL_WAKE_TAGS
    missing = [tag for tag in req.tags if tag not in tuple(WakeTag)]
    if missing:
        raise bad_request(f"tags: Trillium has no {missing[0]!r} memory (it captures no CUDA graphs); "
                          f"its tags are {[t.value for t in WakeTag]}", "tags")
    return tuple(dict.fromkeys(WakeTag(tag) for tag in req.tags))


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("sleep", __name__)

    async def sleep_engine(level: int, mode: PauseMode):
        async with state.exclusive:
            with state.status.closing(EngineState.SLEEPING):
                return await state.run(Sleep(new_command_id(), level=level, mode=mode),
                                       settle_state=EngineState.SLEEPING)

    async def wake_engine(tags: tuple[WakeTag, ...]):
        async with state.exclusive:
            return await state.run(WakeUp(new_command_id(), tags=tags),
                                   settle_state=EngineState.SERVING if set(tags) == set(ALL_WAKE_TAGS) else None)

    @bp.post("/sleep")
    @takes_query("level", "mode")
    async def sleep():
        req = with_query(parse_body(SleepRequest, await request.get_data()), ("level", "mode"))
        reply = await sleep_engine(req.level, req.mode)
        return success(reply, f"sleeping (level {req.level})", level=req.level)

    @bp.post("/wake_up")
    @takes_query("tags")
    async def wake_up():
        req = with_query(parse_body(WakeUpRequest, await request.get_data()), ("tags",))
        tags = tuple(dict.fromkeys(req.tags)) if req.tags else ALL_WAKE_TAGS
        reply = await wake_engine(tags)
        return success(reply, f"woke up {', '.join(tags)}", tags=list(tags))

    @bp.get("/is_sleeping")
    async def is_sleeping():
        return json_response({"is_sleeping": state.status.is_sleeping})

    @bp.route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation():
        tags = _memory_tags(parse_body(MemoryOccupationRequest, await request.get_data()))
        reply = await sleep_engine(1, PauseMode.ABORT)
        kept = tuple(tag for tag in ALL_WAKE_TAGS if tag not in tags)
        if kept:  # WHY: a sleep releases both; waking the other tag leaves only the named one released
            reply = await wake_engine(kept)
        return success(reply, f"released {', '.join(tags)}", tags=list(tags))

    @bp.route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation():
        tags = _memory_tags(parse_body(MemoryOccupationRequest, await request.get_data()))
        reply = await wake_engine(tags)
        return success(reply, f"resumed {', '.join(tags)}", tags=list(tags))

    return bp
