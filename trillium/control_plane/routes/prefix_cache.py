"""POST /reset_prefix_cache: drop every cached prompt block (vLLM's name).

The engine refuses (409) while requests are running; its message says so.
"""

from __future__ import annotations

from quart import Blueprint, request

from trillium.actors.protocol.admin import ResetPrefixCache
from trillium.control_plane.protocol import EmptyRequest, parse_body
from trillium.control_plane.responses import success
from trillium.control_plane.state import AdminState, new_command_id


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("prefix_cache", __name__)

    @bp.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        parse_body(EmptyRequest, await request.get_data())
        reply = await state.run(ResetPrefixCache(new_command_id()))
        return success(reply, "prefix cache reset")

    return bp
