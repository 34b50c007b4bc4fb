"""JSON success responses of the admin routes.

Command routes answer SGLang's shape, `{"success": true, "message": str, ...}`:
the engine reply's data first (its `info()`: state, weight_version,
is_sleeping, kv_usage, ...), then the route's own fields (which win). The
message is the engine's own.
"""

from __future__ import annotations

import json

from quart import Response


def json_response(obj, status: int = 200) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False, separators=(",", ":")), status=status,
                    mimetype="application/json")


def success(reply=None, default_message: str = "", **fields) -> Response:
    """200 with the engine reply's data and message (or `default_message`), then `fields`."""
    data = dict(reply.data) if reply is not None else {}
    message = (reply.message if reply is not None else "") or default_message
    return json_response({**data, "success": True, "message": message, **fields})
