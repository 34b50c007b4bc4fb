"""Ending requests with finish_reason "abort": Trillium's /abort_requests and SGLang's /abort_request.

    POST /abort_requests {"request_ids"?: [...]}
        Without request_ids (or null), every request in the engine is aborted.
        Ids are engine request ids: the data plane's response `id`
        (`cmpl-...`, `chatcmpl-...`), with `-<i>` for choice i when n > 1.
    POST /abort_request {"rid": str, "abort_all": false}   (SGLang's AbortReq)
        rid: that request and its choices (`<rid>-<i>`, `<rid>_<i>`);
        abort_all: every request. Neither is a 400 (SGLang would do nothing).
"""

from __future__ import annotations

import re

from quart import Blueprint, request

from trillium.actors.protocol.admin import AbortRequests
from trillium.control_plane.errors import bad_request
from trillium.control_plane.protocol import AbortRequestRequest, AbortRequestsRequest, parse_body
from trillium.control_plane.responses import success
from trillium.control_plane.state import AdminState, new_command_id


def _matching(rid: str, active: list[str]) -> tuple[str, ...]:
    choice = re.compile(re.escape(rid) + r"[-_]\d+")
    return tuple(i for i in active if i == rid or choice.fullmatch(i))


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("abort", __name__)

    @bp.post("/abort_requests")
    async def abort_requests():
        req = parse_body(AbortRequestsRequest, await request.get_data())
        ids = tuple(req.request_ids) if req.request_ids is not None else None
        reply = await state.run(AbortRequests(new_command_id(), request_ids=ids))
        what = "every request" if ids is None else f"{len(ids)} requests"
        return success(reply, f"aborted {what}")

    @bp.post("/abort_request")
    async def abort_request():
        req = parse_body(AbortRequestRequest, await request.get_data())
        if not req.abort_all and not req.rid:
            raise bad_request("give rid (the request to abort) or abort_all: true", "rid")
        ids = None if req.abort_all else _matching(req.rid, state.engine.client.active_request_ids())
        reply = await state.run(AbortRequests(new_command_id(), request_ids=ids))
        return success(reply, "aborted every request" if ids is None else f"aborted {req.rid!r}")

    return bp
