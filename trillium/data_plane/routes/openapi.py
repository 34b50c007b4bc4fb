"""GET /openapi.json: the data plane's OpenAPI 3 document (built once per app)."""

from __future__ import annotations

from quart import Blueprint

from trillium.data_plane.openapi import build_document
from trillium.data_plane.state import AppState
from trillium.data_plane.streaming import json_response


def blueprint(state: AppState) -> Blueprint:
    bp = Blueprint("openapi", __name__)
    document = build_document(state.engine.version)

    @bp.get("/openapi.json")
    async def openapi():
        return json_response(document)

    return bp
