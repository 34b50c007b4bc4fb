"""Calling an ASGI app in process: its lifespan, and one HTTP request at a time per call.

`run-batch` sends each line through the data plane's own app (create_app) as
an HTTP request that never touches a socket, so a batch line is validated,
tokenized, admitted and answered exactly as `trillium serve` answers it, and a
route added to the data plane works in batch files with no change here.

    async with app_lifespan(app):              # the app's startup / shutdown (its nursery)
        reply = await post_json(app, "/v1/completions", "", {"prompt": "hi"})
        reply.status, reply.headers, reply.body

NOTE: the request's receive channel reports a disconnect only after the
response's last byte is sent: under Quart-Trio a disconnect cancels the
handler (and aborts its engine requests), as a real client going away would.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

_ASGI = {"version": "3.0", "spec_version": "2.3"}
_LOCAL = ("127.0.0.1", 0)


class LifespanFailed(RuntimeError):
    pass


@asynccontextmanager
async def app_lifespan(app):
    """Run `app`'s ASGI lifespan around the block: startup before, shutdown after."""
    to_app, app_inbox = trio.open_memory_channel(1)
    app_outbox, from_app = trio.open_memory_channel(1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app, {"type": "lifespan", "asgi": _ASGI, "state": {}}, app_inbox.receive,
                           app_outbox.send)
        await to_app.send({"type": "lifespan.startup"})
        reply = await from_app.receive()
        if reply["type"] != "lifespan.startup.complete":
            raise LifespanFailed(f"the data plane app did not start: {reply.get('message', reply['type'])}")
        try:
            yield
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await to_app.send({"type": "lifespan.shutdown"})
                await from_app.receive()
            nursery.cancel_scope.cancel()


@attrs.frozen
class HttpReply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def post_json(app, path: str, query: str, body: dict[str, Any]) -> HttpReply:
    """POST `body` as JSON to `path` of `app` and collect the whole response."""
    data = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": _ASGI, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
        "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode())],
        "client": _LOCAL, "server": _LOCAL, "extensions": {},
    }
    sent = trio.Event()
    pending = [{"type": "http.request", "body": data, "more_body": False}]
    status = 0
    headers: dict[str, str] = {}
    chunks: list[bytes] = []

    async def receive():
        if pending:
            return pending.pop()
        await sent.wait()
        return {"type": "http.disconnect"}

    async def send(message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            headers.update((k.decode("latin1").lower(), v.decode("latin1")) for k, v in message["headers"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                sent.set()

    await app(scope, receive, send)
    return HttpReply(status, headers, b"".join(chunks))
