"""GET /v1/models and /v1/models/<name>: the served model name(s), OpenAI's list format.

Each card also reports the engine's current `weight_version` (bumped by
every weight update through the control plane)."""

from __future__ import annotations

from quart import Blueprint

from trillium.data_plane.state import AppState
from trillium.data_plane.streaming import json_response


def _card(state: AppState, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": state.created_s,
        "owned_by": "trillium",
        "root": state.engine.model_name,
        "parent": None,
        "max_model_len": state.engine.max_model_len,
        "weight_version": state.weight_version(),
    }


def blueprint(state: AppState) -> Blueprint:
    bp = Blueprint("models", __name__)

    @bp.get("/v1/models")
    async def list_models():
        return json_response({"object": "list", "data": [_card(state, n) for n in state.engine.served_model_name]})

    @bp.get("/v1/models/<path:name>")
    async def retrieve_model(name: str):
        return json_response(_card(state, state.resolve_model(name)))

    return bp
