"""The admin half of TRL's `trl vllm-serve` routes (trailing slashes included).

TRL's `VLLMClient` (huggingface/trl, trl/generation/vllm_client.py) talks to
TRL's own FastAPI server (trl/scripts/vllm_serve.py), never to vLLM's. Its
generation routes (/health/, /generate/) are the data plane's
(data_plane/routes/trl.py); the weight-sync and cache routes are here, so they
need the admin token, or `--admin-on-data-port` on loopback (TRL's client
sends no auth header and uses one base URL):

    GET  /get_world_size/      -> {"world_size": 1}
        The ranks the server adds to a weight-sync group: Trillium's one
        executor (TRL's server: tensor_parallel_size * data_parallel_size).
    POST /reset_prefix_cache/  -> {"message": "Request received, resetting prefix cache status: True"}
        The same ResetPrefixCache as vLLM's /reset_prefix_cache.
    POST /init_communicator/ {host, port, world_size, client_device_uuid}
    POST /update_named_param/ {name, dtype, shape}
        400: TRL's weight sync is vLLM's StatelessProcessGroup + PyNcclCommunicator
        (NCCL, CUDA only, a vLLM class on the trainer side), which Trillium does
        not speak; the message names the routes that do the same job
        (/init_weights_update_group + /update_weights_from_distributed, torch.distributed,
        or /update_weights_from_tensor). The body is validated first.
    POST /close_communicator/  -> {"message": "Request received, closing communicator"}
        No communicator can be open, so there is nothing to close: TRL's own
        server answers the same when none is open.

Bodies take exactly TRL's fields (pydantic models in vllm_serve.py); any other is a 400.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from quart import Blueprint, request

from trillium.actors.protocol.admin import ResetPrefixCache
from trillium.control_plane.errors import bad_request
from trillium.control_plane.protocol import parse_body
from trillium.control_plane.responses import json_response
from trillium.control_plane.state import AdminState, new_command_id

ENGINE_WORLD_SIZE = 1  # one executor process joins a weight-sync group

_NO_NCCL_COMMUNICATOR = (
    "TRL's weight sync (init_communicator / update_named_param) uses vLLM's StatelessProcessGroup and "
    "PyNcclCommunicator, NCCL on CUDA, which Trillium does not implement. Push weights with Trillium's "
    "torch.distributed group instead: POST /init_weights_update_group {master_address, master_port, "
    "rank_offset, world_size, group_name, backend} then /update_weights_from_distributed {names, dtypes, "
    "shapes} (gloo on CPU, NCCL on GPU; trillium.rlhf.WeightSync does both), or upload a safetensors file "
    "to /update_weights_from_tensor"
)


class _TrlBody(BaseModel):
    model_config = ConfigDict(strict=False, extra="forbid", allow_inf_nan=False)


class TrlEmptyRequest(_TrlBody):
    pass


class TrlInitCommunicatorRequest(_TrlBody):
    host: str
    port: int
    world_size: int
    client_device_uuid: str


class TrlUpdateNamedParamRequest(_TrlBody):
    name: str
    dtype: str
    shape: list[int]


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("trl", __name__)

    @bp.get("/get_world_size/")
    async def get_world_size():
        return json_response({"world_size": ENGINE_WORLD_SIZE})

    @bp.post("/reset_prefix_cache/")
    async def reset_prefix_cache():
        parse_body(TrlEmptyRequest, await request.get_data())
        reply = await state.run(ResetPrefixCache(new_command_id()))
        return json_response({"message": f"Request received, resetting prefix cache status: {reply.ok}"})

    @bp.post("/init_communicator/")
    async def init_communicator():
        parse_body(TrlInitCommunicatorRequest, await request.get_data())
        raise bad_request(_NO_NCCL_COMMUNICATOR)

    @bp.post("/update_named_param/")
    async def update_named_param():
        parse_body(TrlUpdateNamedParamRequest, await request.get_data())
        raise bad_request(_NO_NCCL_COMMUNICATOR)

    @bp.post("/close_communicator/")
    async def close_communicator():
        parse_body(TrlEmptyRequest, await request.get_data())
        return json_response({"message": "Request received, closing communicator (none was open: Trillium "
                                         "does not open TRL's NCCL communicator)"})

    return bp
