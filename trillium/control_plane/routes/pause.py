"""POST /pause, POST /resume, GET /is_paused (vLLM's pause_generation names).

    /pause {"mode": "abort" | "wait" | "keep"}
        abort: requests in flight end with finish_reason "abort";
        wait:  they finish, then the engine pauses;
        keep:  they stay frozen and continue after /resume (on whatever
               weights are loaded by then: vLLM's partial-rollout flow).
    /resume
    /is_paused -> {"is_paused": bool}

While paused the data plane answers 503 + Retry-After.
"""

from __future__ import annotations

from quart import Blueprint, request

from trillium.actors.protocol.admin import Pause, Resume
from trillium.actors.protocol.vocabulary import EngineState
from trillium.control_plane.protocol import EmptyRequest, PauseRequest, parse_body
from trillium.control_plane.responses import json_response, success
from trillium.control_plane.state import AdminState, new_command_id


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("pause", __name__)

    @bp.post("/pause")
    async def pause():
        req = parse_body(PauseRequest, await request.get_data())
        with state.status.closing(EngineState.PAUSED):
            reply = await state.run(Pause(new_command_id(), mode=req.mode), settle_state=EngineState.PAUSED)
        return success(reply, f"paused (mode {req.mode})", mode=req.mode)

    @bp.post("/resume")
    async def resume():
        parse_body(EmptyRequest, await request.get_data())
        reply = await state.run(Resume(new_command_id()), settle_state=EngineState.SERVING)
        return success(reply, "resumed")

    @bp.get("/is_paused")
    async def is_paused():
        return json_response({"is_paused": state.status.is_paused})

    return bp
