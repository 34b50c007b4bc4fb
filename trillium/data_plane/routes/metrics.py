"""GET /metrics: this app's Prometheus registry in the text exposition format."""

from __future__ import annotations

from quart import Blueprint, Response

from trillium.data_plane.metrics import CONTENT_TYPE
from trillium.data_plane.state import AppState


def blueprint(state: AppState) -> Blueprint:
    bp = Blueprint("metrics", __name__)

    @bp.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), status=200, content_type=CONTENT_TYPE)

    return bp
