"""AReaL's vLLM server extension routes (`/areal_*`), on Trillium's own pause / update / group commands.

AReaL runs vLLM with its own routes added (inclusionAI/AReaL,
areal/engine/vllm_ext/areal_vllm_server.py) and calls them from
areal/engine/vllm_remote.py (`VLLMBackend`). Each maps onto the command
Trillium's own route for the same operation runs; nothing here is a second
implementation:

    POST /areal_pause_generation {}
        AReaL aborts every running and waiting request, resets the prefix
        cache and holds new completions: Pause(mode abort), ResetPrefixCache.
        NOTE: while paused, Trillium's data plane answers 503 + Retry-After
        where AReaL's patched /v1/completions waits for the continue.
    POST /areal_continue_generation {}                 -> Resume
    POST /areal_update_weights {"model_path", "load_format": "auto", "abort_all_requests": false}
        A disk update (routes/weights.load_from_disk: allowed paths, version
        bump). AReaL's engine aborts the requests in flight first whatever
        abort_all_requests says; so does this route. load_format: only
        "auto" (or null): Trillium reads the directory's safetensors.
    POST /areal_init_weights_update_group {"master_address", "master_port" (a string),
                                           "rank_offset", "world_size", "backend", "group_name"}
        The same join as /init_weights_update_group (SGLang's recipe).
    POST /areal_set_update_weight_meta {"names", "dtypes", "shapes", "group_name"}
        Remembers the tensors the next broadcast carries (checked as
        /update_weights_from_distributed checks them); answers at once.
    POST /areal_update_weights_xccl {}
        Receives those tensors by broadcast (the trainer broadcasts while this
        call is in flight), requests in flight aborted first as in AReaL: the
        same command as /update_weights_from_distributed. 400 before any meta.

Answers are AReaL's `{"success": true, "message": str}`; a failure is the
admin error shape, which carries `"success": false` and `"message"` too
(errors.py), with its own status (AReaL's server says 400 for every failure).
Bodies take exactly AReaL's fields: any other is a 400. AReaL's LoRA variants
(/areal_update_weights_lora, /areal_update_weights_lora_xccl,
/areal_set_update_weight_meta_lora) are not served (404).

State: the last meta set (route-local; AReaL sends it before every update).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from quart import Blueprint, request

from trillium.actors.protocol.admin import (
    Pause,
    ResetPrefixCache,
    Resume,
    UpdateWeightsFromDistributed,
)
from trillium.actors.protocol.vocabulary import EngineState, PauseMode
from trillium.control_plane.errors import bad_request
from trillium.control_plane.protocol import InitGroupRequest, UpdateFromDistributedRequest, parse_body
from trillium.control_plane.responses import json_response
from trillium.control_plane.routes.distributed import join_group
from trillium.control_plane.routes.weights import load_from_disk
from trillium.control_plane.state import AdminState, new_command_id


class _ArealBody(BaseModel):
    # WHY lax: AReaL's bodies are vLLM OpenAIBaseModels (pydantic's lax mode; master_port is a string).
    model_config = ConfigDict(strict=False, extra="forbid", allow_inf_nan=False)


class ArealEmptyRequest(_ArealBody):
    pass


class ArealUpdateWeightsRequest(_ArealBody):
    model_path: Annotated[str, Field(min_length=1)]
    load_format: Literal["auto"] | None = "auto"
    abort_all_requests: bool = False  # AReaL's engine aborts either way (module docstring)


class ArealInitGroupRequest(InitGroupRequest):
    # AReaL's fields exactly (Trillium's timeout_s too); lax: master_port comes as a string.
    model_config = ConfigDict(strict=False, extra="forbid", allow_inf_nan=False)


class ArealWeightMetaRequest(_ArealBody):
    """The fields AReaL sends; their values are checked as UpdateFromDistributedRequest checks them."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: Annotated[str, Field(min_length=1)]


def _answer(message: str):
    return json_response({"success": True, "message": message})


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("areal", __name__)
    meta: dict[str, UpdateFromDistributedRequest] = {}  # "last": the meta the next xccl update uses

    @bp.post("/areal_pause_generation")
    async def pause_generation():
        parse_body(ArealEmptyRequest, await request.get_data())
        with state.status.closing(EngineState.PAUSED):
            await state.run(Pause(new_command_id(), mode=PauseMode.ABORT), settle_state=EngineState.PAUSED)
        await state.run(ResetPrefixCache(new_command_id()))
        return _answer("Generation paused and all requests aborted")

    @bp.post("/areal_continue_generation")
    async def continue_generation():
        parse_body(ArealEmptyRequest, await request.get_data())
        await state.run(Resume(new_command_id()), settle_state=EngineState.SERVING)
        return _answer("Generation continued")

    @bp.post("/areal_update_weights")
    async def update_weights():
        req = parse_body(ArealUpdateWeightsRequest, await request.get_data())
        _, path = await load_from_disk(state, req.model_path, abort_all_requests=True)
        return _answer(f"loaded weights from {path} (weight version {state.status.weight_version})")

    @bp.post("/areal_init_weights_update_group")
    async def init_group():
        req = parse_body(ArealInitGroupRequest, await request.get_data())
        await join_group(state, req)
        return _answer(f"joined weight update group {req.group_name!r} as rank {req.rank_offset}")

    @bp.post("/areal_set_update_weight_meta")
    async def set_weight_meta():
        body = await request.get_data()
        parse_body(ArealWeightMetaRequest, body)  # exactly AReaL's fields
        meta["last"] = parse_body(UpdateFromDistributedRequest, body)  # names unique, known dtypes, lengths
        return _answer(f"weight meta set: {len(meta['last'].names)} tensors")

    @bp.post("/areal_update_weights_xccl")
    async def update_weights_xccl():
        parse_body(ArealEmptyRequest, await request.get_data())
        req = meta.get("last")
        if req is None:
            raise bad_request("no weight meta: POST /areal_set_update_weight_meta {names, dtypes, shapes, "
                              "group_name} first")
        command = UpdateWeightsFromDistributed(
            new_command_id(), names=tuple(req.names), dtypes=tuple(req.dtypes),
            shapes=tuple(tuple(shape) for shape in req.shapes), weight_version=None, flush_cache=True,
            group_name=req.group_name,
        )
        await state.update_weights(command, source="distributed", abort_all_requests=True)
        return _answer(f"received {len(req.names)} tensors (weight version {state.status.weight_version})")

    return bp
