"""POST /abort_requests {"request_ids"?: [...]}: end requests with finish_reason "abort".

Without request_ids (or null), every request in the engine is aborted.
Ids are engine request ids: the data plane's response `id`
(`cmpl-...`, `chatcmpl-...`), with `-<i>` for choice i when n > 1.
"""

from __future__ import annotations

from quart import Blueprint, request

from trillium.actors.protocol.admin import AbortRequests
from trillium.control_plane.protocol import AbortRequestsRequest, parse_body
from trillium.control_plane.responses import success
from trillium.control_plane.state import AdminState, new_command_id


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("abort", __name__)

    @bp.post("/abort_requests")
    async def abort_requests():
        req = parse_body(AbortRequestsRequest, await request.get_data())
        ids = tuple(req.request_ids) if req.request_ids is not None else None
        reply = await state.run(AbortRequests(new_command_id(), request_ids=ids))
        what = "every request" if ids is None else f"{len(ids)} requests"
        return success(reply, f"aborted {what}")

    return bp
