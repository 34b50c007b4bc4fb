"""GET /health: 200 when every engine actor is alive, else 503 (token required, as every route)."""

from __future__ import annotations

from quart import Blueprint

from trillium.control_plane.responses import json_response
from trillium.control_plane.state import AdminState


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("health", __name__)

    @bp.get("/health")
    async def health():
        ok, detail = state.healthy()
        body = {"status": "ok" if ok else "unhealthy", "engine_state": state.status.engine_state,
                "weight_version": state.status.weight_version}
        if not ok:
            body["detail"] = str(detail)
        return json_response(body, status=200 if ok else 503)

    return bp
