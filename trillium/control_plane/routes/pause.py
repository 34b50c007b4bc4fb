"""Pause and resume: vLLM's /pause, /resume, /is_paused and SGLang's /pause_generation, /continue_generation.

    /pause {"mode": "abort" | "wait" | "keep" | "retract"}   or vLLM's query form
    /pause?mode=keep&wait_for_inflight_requests=false&clear_cache=true
        abort:   requests in flight end with finish_reason "abort";
        wait:    they finish, then the engine pauses (wait_for_inflight_requests=true says the same);
        keep:    they stay frozen and continue after /resume (on whatever
                 weights are loaded by then: vLLM's partial-rollout flow);
        retract: they go back to the queue, their KV freed, and recompute after /resume.
        clear_cache=true resets the prefix cache once paused (not with keep, as in vLLM);
        without it Trillium keeps the cache (every weight update flushes it anyway).
    /resume
    /is_paused -> {"is_paused": bool}

    /pause_generation {"mode": "abort" | "retract" | "in_place"}  (SGLang, default abort)
        abort -> abort; in_place -> keep (the requests stay where they are, KV
        kept, as SGLang's in_place); retract -> retract (back to the waiting
        queue, KV freed, recomputed after /continue_generation, as SGLang's
        retract; Trillium's keep would preempt nothing).
        -> {"message": "Generation paused successfully.", "status": "ok", ...}
    /continue_generation -> {"message": "Generation continued successfully.", "status": "ok", ...}

While paused the data plane answers 503 + Retry-After.
"""

from __future__ import annotations

from quart import Blueprint, request

from trillium.actors.protocol.admin import Pause, ResetPrefixCache, Resume
from trillium.actors.protocol.vocabulary import EngineState, PauseMode
from trillium.control_plane.errors import bad_request
from trillium.control_plane.protocol import EmptyRequest, PauseGenerationRequest, PauseRequest, parse_body
from trillium.control_plane.query import takes_query, with_query
from trillium.control_plane.responses import json_response, success
from trillium.control_plane.state import AdminState, new_command_id

_SGLANG_MODES = {"abort": PauseMode.ABORT, "in_place": PauseMode.KEEP, "retract": PauseMode.RETRACT}
_VLLM_QUERY = ("mode", "wait_for_inflight_requests", "clear_cache")


def _vllm_mode(req: PauseRequest) -> PauseMode:
    if not req.wait_for_inflight_requests:
        return req.mode
    if "mode" in req.model_fields_set and req.mode is not PauseMode.WAIT:
        raise bad_request(f"wait_for_inflight_requests=true means mode \"wait\", not {req.mode!r}", "mode")
    return PauseMode.WAIT


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("pause", __name__)

    async def pause_engine(mode: PauseMode):
        with state.status.closing(EngineState.PAUSED):
            return await state.run(Pause(new_command_id(), mode=mode), settle_state=EngineState.PAUSED)

    @bp.post("/pause")
    @takes_query(*_VLLM_QUERY)
    async def pause():
        req = with_query(parse_body(PauseRequest, await request.get_data()), _VLLM_QUERY)
        mode = _vllm_mode(req)
        reply = await pause_engine(mode)
        cleared = bool(req.clear_cache) and mode is not PauseMode.KEEP
        if cleared:
            await state.run(ResetPrefixCache(new_command_id()))
        return success(reply, f"paused (mode {mode})", mode=mode, status="paused", cache_cleared=cleared)

    @bp.post("/resume")
    async def resume():
        parse_body(EmptyRequest, await request.get_data())
        reply = await state.run(Resume(new_command_id()), settle_state=EngineState.SERVING)
        return success(reply, "resumed", status="resumed")

    @bp.get("/is_paused")
    async def is_paused():
        return json_response({"is_paused": state.status.is_paused})

    @bp.post("/pause_generation")
    async def pause_generation():
        req = parse_body(PauseGenerationRequest, await request.get_data())
        reply = await pause_engine(_SGLANG_MODES[req.mode])
        return json_response({**reply.data, "success": True, "status": "ok", "mode": req.mode,
                              "message": "Generation paused successfully."})

    @bp.post("/continue_generation")
    async def continue_generation():
        parse_body(EmptyRequest, await request.get_data())
        reply = await state.run(Resume(new_command_id()), settle_state=EngineState.SERVING)
        return json_response({**reply.data, "success": True, "status": "ok",
                              "message": "Generation continued successfully."})

    return bp
