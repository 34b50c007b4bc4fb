"""GET /health (200 healthy, 503 not) and GET /version; both open without an API key."""

from __future__ import annotations

from quart import Blueprint

from trillium.data_plane.state import AppState
from trillium.data_plane.streaming import json_response


def blueprint(state: AppState) -> Blueprint:
    bp = Blueprint("health", __name__)

    @bp.get("/health")
    @bp.get("/health/")  # TRL vllm-serve's spelling (trl/scripts/vllm_serve.py), the same probe
    async def health():
        ok, detail = state.healthy()
        if ok:
            return json_response({"status": "ok"})
        return json_response({"status": "unhealthy", "detail": str(detail)}, status=503)

    @bp.get("/version")
    async def version():
        return json_response({"version": state.engine.version})

    return bp
