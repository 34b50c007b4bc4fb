"""A cap on the connections the data plane serves at once (an ASGI middleware).

`ConnectionLimit(app, limit)` wraps the app's ASGI callable (create_app
sets `app.asgi_app` to it). It counts HTTP requests in progress, from the
first ASGI call to its return (a streamed response counts until its last
byte). Under HTTP/1.1 a connection carries one request at a time, so this
is the number of connections with a request in progress; a connection
with none is idle, and Hypercorn closes it after its keep-alive timeout
(5 s). One request over the limit is answered at once, without reading its
body: 503, Retry-After, `Connection: close`, OpenAI's error shape.

WHY here and not in Hypercorn: its config has no connection cap, and its
trio worker builds the listeners itself; the ASGI layer is the first place
a connection's work becomes visible. Lifespan and other scopes pass through.

State: the count of requests in progress (one event loop: no lock needed).
"""

from __future__ import annotations

import json

RETRY_AFTER_S = 1


class ConnectionLimit:
    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.num_active = 0
        self.num_refused_total = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.limit:
            await self.app(scope, receive, send)
            return
        if self.num_active >= self.limit:
            self.num_refused_total += 1
            await _refuse(send, self.limit)
            return
        self.num_active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_active -= 1


async def _refuse(send, limit: int) -> None:
    body = json.dumps({"error": {
        "message": f"The server is serving its limit of {limit} connections at once "
                   "(--max-concurrent-connections). Retry later.",
        "type": "server_overloaded", "param": None, "code": "too_many_connections",
    }}).encode()
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close"),
    ]})
    await send({"type": "http.response.body", "body": body})
