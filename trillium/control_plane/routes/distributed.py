"""Weight updates broadcast by a trainer over torch.distributed (SGLang's three calls).

    POST /init_weights_update_group {"master_address", "master_port", "rank_offset": 1,
                                     "world_size": 2, "group_name", "backend": "gloo" | "nccl",
                                     "timeout_s": 60}
        The engine's executor joins the trainer's group as rank
        `rank_offset` (the trainer is rank 0 and hosts the TCPStore), by
        SGLang's recipe (`trillium/distributed/update_group.py`), so a
        trainer using `init_custom_process_group` meets it. The reply comes
        once the group is formed, or with a 504 after timeout_s if the
        trainer never joins; meanwhile the engine keeps generating (the
        join runs off the step path) and other admin calls are answered (a
        second init: 409 at once).
    POST /update_weights_from_distributed {"names", "dtypes", "shapes", "weight_version"?,
                                           "group_name"?, "flush_cache": true,
                                           "abort_all_requests": false}
        The engine receives each tensor by broadcast from rank 0, in the
        order given, then loads them all at once, between two steps. The
        trainer broadcasts while this call is in flight
        (`trillium.rlhf.WeightSync.push`). A `group_name` other than the
        open group's is a 409.
    POST /destroy_weights_update_group {"group_name"?}
"""

from __future__ import annotations

from quart import Blueprint, request

from trillium.actors.protocol.admin import (
    ControlReply,
    DestroyWeightsUpdateGroup,
    InitWeightsUpdateGroup,
    UpdateWeightsFromDistributed,
)
from trillium.control_plane.protocol import (
    DestroyGroupRequest,
    InitGroupRequest,
    UpdateFromDistributedRequest,
    parse_body,
)
from trillium.control_plane.errors import bad_request
from trillium.control_plane.responses import success
from trillium.control_plane.state import AdminState, new_command_id

# WHY: the engine answers an init only after its own timeout_s; give it room to say so.
_INIT_REPLY_MARGIN_S = 30.0


async def join_group(state: AdminState, req: InitGroupRequest) -> ControlReply:
    """The engine joins the trainer's group (this route's, and AReaL's /areal_init_weights_update_group)."""
    command = InitWeightsUpdateGroup(
        new_command_id(), master_address=req.master_address, master_port=req.master_port,
        rank_offset=req.rank_offset, world_size=req.world_size, group_name=req.group_name,
        backend=req.backend, timeout_s=req.timeout_s,
    )
    # WHY not under state.exclusive: the join may wait timeout_s for the trainer; the
    # engine orders it (a second init is refused there at once, not after this one).
    return await state.run(command, timeout_s=req.timeout_s + _INIT_REPLY_MARGIN_S)


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("distributed", __name__)

    @bp.post("/init_weights_update_group")
    async def init_group():
        req = parse_body(InitGroupRequest, await request.get_data())
        reply = await join_group(state, req)
        return success(reply, f"joined weight update group {req.group_name!r} as rank {req.rank_offset}")

    @bp.post("/update_weights_from_distributed")
    async def update_from_distributed():
        req = parse_body(UpdateFromDistributedRequest, await request.get_data())
        if req.draft_model_only:  # WHY refused: the trainer's broadcast is the target's (the draft's: disk/tensor)
            raise bad_request("draft_model_only is not implemented for update_weights_from_distributed: update "
                              "the draft from disk or with /update_weights_from_tensor", "draft_model_only")
        command = UpdateWeightsFromDistributed(
            new_command_id(), names=tuple(req.names), dtypes=tuple(req.dtypes),
            shapes=tuple(tuple(shape) for shape in req.shapes),
            weight_version=req.weight_version, flush_cache=req.flush_cache, group_name=req.group_name,
        )
        reply = await state.update_weights(command, source="distributed",
                                          abort_all_requests=req.abort_all_requests)
        return success(reply, f"received {len(req.names)} tensors", weight_version=state.status.weight_version)

    @bp.post("/destroy_weights_update_group")
    async def destroy_group():
        req = parse_body(DestroyGroupRequest, await request.get_data())
        async with state.exclusive:
            reply = await state.run(DestroyWeightsUpdateGroup(new_command_id(), group_name=req.group_name))
        return success(reply, "weight update group destroyed")

    return bp
