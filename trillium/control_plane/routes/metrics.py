"""GET /metrics: the admin app's Prometheus registry (weight version, sleep / pause state, updates)."""

from __future__ import annotations

from quart import Blueprint, Response

from trillium.control_plane.metrics import CONTENT_TYPE
from trillium.control_plane.state import AdminState


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("metrics", __name__)

    @bp.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), status=200, content_type=CONTENT_TYPE)

    return bp
