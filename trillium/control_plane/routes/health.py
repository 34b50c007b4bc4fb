"""GET /health and SGLang's GET /health_generate (token required, as every route).

    /health           200 when every engine actor is alive, else 503.
    /health_generate  also runs a one-token greedy generation (prompt: token 0,
                      as SGLang's health check) through the whole engine; 200
                      once it finishes, 503 when an actor is down, the engine
                      is not serving (asleep, paused, updating) or the token
                      does not come within 20 s (SGLang's HEALTH_CHECK_TIMEOUT).
"""

from __future__ import annotations

import uuid

import trio
from quart import Blueprint

from trillium.actors.protocol.vocabulary import EngineState
from trillium.control_plane.responses import json_response
from trillium.control_plane.state import AdminState
from trillium.sampling_params import SamplingParams

HEALTH_GENERATE_TIMEOUT_S = 20.0


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("health", __name__)

    def body(ok: bool, detail=None) -> dict:
        out = {"status": "ok" if ok else "unhealthy", "engine_state": state.status.engine_state,
               "weight_version": state.status.weight_version}
        if not ok:
            out["detail"] = str(detail)
        return out

    @bp.get("/health")
    async def health():
        ok, detail = state.healthy()
        return json_response(body(ok, detail), status=200 if ok else 503)

    @bp.get("/health_generate")
    async def health_generate():
        ok, detail = state.healthy()
        if ok and state.status.engine_state is not EngineState.SERVING:
            ok, detail = False, f"the engine is {state.status.engine_state}, not serving"
        if ok:
            ok, detail = await _generate_one_token(state)
        return json_response(body(ok, detail), status=200 if ok else 503)

    return bp


async def _generate_one_token(state: AdminState) -> tuple[bool, str]:
    client = state.engine.client
    request_id = f"health-generate-{uuid.uuid4().hex[:16]}"
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    stream = await client.submit(request_id, [0], params, eos_token_ids=())
    with trio.move_on_after(HEALTH_GENERATE_TIMEOUT_S):
        async for delta in stream:
            if delta.finished:
                return True, "ok"
    await client.abort([request_id])
    return False, f"no token within {HEALTH_GENERATE_TIMEOUT_S:g} s"
