"""POST /sleep, POST /wake_up, GET /is_sleeping (vLLM's names and bodies).

    /sleep    {"level": 1 | 2, "mode": "abort" | "wait" | "keep"}
              level 1: weights to host memory, KV cache freed; level 2: both freed.
              mode: what happens to requests in flight (default abort).
    /wake_up  {"tags": ["weights", "kv_cache"]}   (default: both)
    /is_sleeping -> {"is_sleeping": bool}

While the sleep command runs and after it, the data plane answers 503 +
Retry-After. A partial wake (one tag) leaves the engine sleeping.
"""

from __future__ import annotations

from quart import Blueprint, request

from trillium.actors.protocol.admin import Sleep, WakeUp
from trillium.actors.protocol.vocabulary import ALL_WAKE_TAGS, EngineState
from trillium.control_plane.protocol import SleepRequest, WakeUpRequest, parse_body
from trillium.control_plane.responses import json_response, success
from trillium.control_plane.state import AdminState, new_command_id


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("sleep", __name__)

    @bp.post("/sleep")
    async def sleep():
        req = parse_body(SleepRequest, await request.get_data())
        async with state.exclusive:
            with state.status.closing(EngineState.SLEEPING):
                reply = await state.run(Sleep(new_command_id(), level=req.level, mode=req.mode),
                                       settle_state=EngineState.SLEEPING)
        return success(reply, f"sleeping (level {req.level})", level=req.level)

    @bp.post("/wake_up")
    async def wake_up():
        req = parse_body(WakeUpRequest, await request.get_data())
        tags = tuple(dict.fromkeys(req.tags)) if req.tags else ALL_WAKE_TAGS
        woke_all = set(tags) == set(ALL_WAKE_TAGS)
        async with state.exclusive:
            reply = await state.run(WakeUp(new_command_id(), tags=tags),
                                    settle_state=EngineState.SERVING if woke_all else None)
        return success(reply, f"woke up {', '.join(tags)}", tags=list(tags))

    @bp.get("/is_sleeping")
    async def is_sleeping():
        return json_response({"is_sleeping": state.status.is_sleeping})

    return bp

