"""prime-rl's weight-update route: POST /update_weights {"weight_dir"}.

prime-rl serves vLLM with a few routes of its own (PrimeIntellect-ai/prime-rl,
src/prime_rl/inference/vllm/server.py); its orchestrator calls, per step,
`POST /pause?mode=keep&clear_cache=false`, `POST /update_weights {"weight_dir"}`,
`POST /resume` (`update_weights`, src/prime_rl/utils/client.py). Pause and
resume are vLLM's and live in routes/pause.py; this module adds the update:

    POST /update_weights {"weight_dir": str, "skip_prefix_cache_reset": false}
        Loads the checkpoint directory (routes/weights.load_from_disk: allowed
        paths, one atomic update, weight version bumped). The prefix cache is
        reset unless skip_prefix_cache_reset (prime-rl's server does the
        same). On a paused engine (mode keep) the requests frozen in flight
        stay; they continue on the new weights after /resume, vLLM's
        partial-rollout flow. -> {"status": "ok"} (prime-rl's answer)

Other fields are a 400 (prime-rl's client sends weight_dir alone; its
orchestrator also drops a NCCL_READY marker file into weight_dir, which the
loader ignores: it reads the directory's *.safetensors).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
from quart import Blueprint, request

from trillium.control_plane.protocol import parse_body
from trillium.control_plane.responses import json_response
from trillium.control_plane.routes.weights import load_from_disk
from trillium.control_plane.state import AdminState


class PrimeRlUpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    weight_dir: Annotated[str, Field(min_length=1)]
    skip_prefix_cache_reset: bool = False


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("prime_rl", __name__)

    @bp.post("/update_weights")
    async def update_weights():
        req = parse_body(PrimeRlUpdateWeightsRequest, await request.get_data())
        reply, _ = await load_from_disk(state, req.weight_dir, flush_cache=not req.skip_prefix_cache_reset,
                                        param="weight_dir")
        return json_response({"status": "ok", "weight_version": state.status.weight_version,
                              "message": reply.message})

    return bp
