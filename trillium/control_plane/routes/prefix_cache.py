"""Dropping the prefix cache: vLLM's POST /reset_prefix_cache, SGLang's GET / POST /flush_cache.

    /reset_prefix_cache?reset_running_requests=false&reset_external=true
        Drops every cached prompt block, the host and disk KV tiers' too.
        Requests running keep their blocks (never found again). vLLM's
        reset_running_requests=true (preempt them first) and reset_external=false
        (keep the offloaded tiers) are 400s: Trillium does neither.
    /flush_cache[?timeout=S]  -> 200 text/plain "Cache flushed.\n" (SGLang's answer)
        The same reset; it never waits, so SGLang's timeout is always met.
"""

from __future__ import annotations

from quart import Blueprint, Response, request

from trillium.actors.protocol.admin import ResetPrefixCache
from trillium.control_plane.errors import bad_request
from trillium.control_plane.protocol import FlushCacheRequest, ResetPrefixCacheRequest, parse_body
from trillium.control_plane.query import query_fields, takes_query, with_query
from trillium.control_plane.responses import success
from trillium.control_plane.state import AdminState, new_command_id

_VLLM_QUERY = ("reset_running_requests", "reset_external")


def blueprint(state: AdminState) -> Blueprint:
    bp = Blueprint("prefix_cache", __name__)

    @bp.post("/reset_prefix_cache")
    @takes_query(*_VLLM_QUERY)
    async def reset_prefix_cache():
        req = with_query(parse_body(ResetPrefixCacheRequest, await request.get_data()), _VLLM_QUERY)
        if req.reset_running_requests:
            raise bad_request("reset_running_requests=true is not supported: Trillium's reset leaves running "
                              "requests their blocks (they are never found again)", "reset_running_requests")
        if req.reset_external is False:
            raise bad_request("reset_external=false is not supported: Trillium's reset always drops the host "
                              "and disk KV tiers too", "reset_external")
        reply = await state.run(ResetPrefixCache(new_command_id()))
        return success(reply, "prefix cache reset")

    @bp.route("/flush_cache", methods=["GET", "POST"])
    @takes_query("timeout")
    async def flush_cache():
        parse_body(FlushCacheRequest, await request.get_data())
        query_fields(FlushCacheRequest, ("timeout",))  # validated; the flush below never waits
        await state.run(ResetPrefixCache(new_command_id()))
        return Response("Cache flushed.\n", status=200, mimetype="text/plain")

    return bp
