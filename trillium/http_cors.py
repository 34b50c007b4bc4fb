"""CORS for the data plane: vLLM's --allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials.

    with_cors(app, CorsPolicy(...)) -> ASGI app

vLLM wraps its API server in Starlette's CORSMiddleware with those four
flags (vllm/entrypoints/openai/cli_args.py; defaults ["*"], ["*"], ["*"],
False). This is the same behaviour as a small ASGI wrapper, so the
QuartTrio app needs no extra dependency:

- a preflight (OPTIONS with Origin and Access-Control-Request-Method) is
  answered here: 200 with the allowed origin, methods, headers and max age,
  or 400 naming what is not allowed; it never reaches the routes;
- any other request with an allowed Origin gets Access-Control-Allow-Origin
  (the origin itself when credentials are allowed or the list is explicit,
  else `*`) and, with credentials, Access-Control-Allow-Credentials.

No state beyond the frozen policy. Trillium turns it on only when one of
the flags is given (vLLM always installs it).
"""

from __future__ import annotations

import attrs

_ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
_MAX_AGE_S = "600"


def _strings(value) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a JSON list of strings, got {value!r}")
    return tuple(value)


@attrs.frozen
class CorsPolicy:
    allowed_origins: tuple[str, ...] = attrs.field(default=("*",), converter=_strings)
    allowed_methods: tuple[str, ...] = attrs.field(default=("*",), converter=_strings)
    allowed_headers: tuple[str, ...] = attrs.field(default=("*",), converter=_strings)
    allow_credentials: bool = False

    def allows_origin(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin in self.allowed_origins

    def allows_method(self, method: str) -> bool:
        return "*" in self.allowed_methods or method.upper() in (m.upper() for m in self.allowed_methods)

    def origin_header(self, origin: str) -> str:
        # WHY echo the origin: with credentials browsers refuse `*` (Starlette does the same).
        if "*" in self.allowed_origins and not self.allow_credentials:
            return "*"
        return origin

    def simple_headers(self, origin: str) -> list[tuple[bytes, bytes]]:
        headers = [(b"access-control-allow-origin", self.origin_header(origin).encode())]
        if self.allow_credentials:
            headers.append((b"access-control-allow-credentials", b"true"))
        if self.origin_header(origin) != "*":
            headers.append((b"vary", b"Origin"))
        return headers

    def preflight(self, origin: str, method: str, requested_headers: str) -> tuple[int, list, bytes]:
        """(status, headers, body) of the answer to a preflight request."""
        problems = []
        if not self.allows_origin(origin):
            problems.append("origin")
        if not self.allows_method(method):
            problems.append("method")
        wanted = [h.strip().lower() for h in requested_headers.split(",") if h.strip()]
        allowed = {h.lower() for h in self.allowed_headers}
        if "*" not in allowed and any(h not in allowed for h in wanted):
            problems.append("headers")
        methods = _ALL_METHODS if "*" in self.allowed_methods else self.allowed_methods
        headers = [(b"access-control-allow-methods", ", ".join(methods).encode()),
                   (b"access-control-max-age", _MAX_AGE_S.encode())]
        if wanted:
            allow = requested_headers if "*" in allowed else ", ".join(self.allowed_headers)
            headers.append((b"access-control-allow-headers", allow.encode()))
        if problems:
            body = f"Disallowed CORS {', '.join(problems)}".encode()
            return 400, headers + [(b"content-type", b"text/plain")], body
        return 200, self.simple_headers(origin) + headers + [(b"content-type", b"text/plain")], b"OK"


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def with_cors(app, policy: CorsPolicy):
    """`app` behind the CORS policy (HTTP only; lifespan and others pass through)."""

    async def cors(scope, receive, send) -> None:
        origin = _header(scope, b"origin") if scope["type"] == "http" else None
        if origin is None:
            await app(scope, receive, send)
            return
        method = _header(scope, b"access-control-request-method")
        if scope["method"] == "OPTIONS" and method is not None:
            status, headers, body = policy.preflight(origin, method,
                                                     _header(scope, b"access-control-request-headers") or "")
            await send({"type": "http.response.start", "status": status,
                        "headers": headers + [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        if not policy.allows_origin(origin):
            await app(scope, receive, send)
            return

        async def send_with_cors(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *policy.simple_headers(origin)]}
            await send(message)

        await app(scope, receive, send_with_cors)

    return cors
