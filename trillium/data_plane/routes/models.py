"""GET /v1/models and /v1/models/<name>: the served model name(s), OpenAI's list format.

Each card also reports the engine's current `weight_version` (bumped by
every weight update through the control plane). LoRA adapters get a card
each, as vLLM lists them: `root` is the adapter's directory, `parent` the
base model."""

from __future__ import annotations

from quart import Blueprint

from trillium.data_plane.state import AppState
from trillium.data_plane.streaming import json_response


def _card(state: AppState, name: str) -> dict:
    adapter = None if state.engine.loras is None else state.engine.loras.get(name)
    return {
        "id": name,
        "object": "model",
        "created": state.created_s,
        "owned_by": "trillium",
        "root": state.engine.model_name if adapter is None else adapter.path,
        "parent": None if adapter is None else state.engine.model_name,
        "max_model_len": state.engine.max_model_len,
        "weight_version": state.weight_version(),
    }


def blueprint(state: AppState) -> Blueprint:
    bp = Blueprint("models", __name__)

    @bp.get("/v1/models")
    async def list_models():
        names = list(state.engine.served_model_name)
        if state.engine.loras is not None:
            names += [module.name for module in state.engine.loras.served()]
        return json_response({"object": "list", "data": [_card(state, n) for n in names]})

    @bp.get("/v1/models/<path:name>")
    async def retrieve_model(name: str):
        return json_response(_card(state, state.resolve_model(name)))

    return bp
