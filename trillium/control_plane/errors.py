"""Errors of the admin API, in the data plane's wire shape, rendered once in app.py.

    {"error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}

The control plane never imports the data plane, so the few lines that make
this shape live here too. `from_reply` turns an engine `ControlReply`
whose status is an error (400 / 403 / 409 / 500 / 504) into the same
status on the wire, with the engine's message.
"""

from __future__ import annotations

import json

from quart import Response

from trillium.actors.protocol.lifecycle import ControlReply

# WHY these names: OpenAI's error types where one fits; the rest follow its pattern.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class AdminError(Exception):
    """An error response: status, error body, optional extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self) -> Response:
        response = Response(json.dumps(self.body(), ensure_ascii=False), status=self.status,
                            mimetype="application/json")
        for name, value in self.headers.items():
            response.headers[name] = value
        return response


def bad_request(message: str, param: str | None = None) -> AdminError:
    return AdminError(400, message, param=param)


def unauthorized() -> AdminError:
    # WHY Connection: close: a refused client may have sent a large body
    # (a safetensors upload) that we do not read; closing keeps the
    # keep-alive connection from going out of step.
    return AdminError(
        401, "Missing or incorrect admin token (Authorization: Bearer <admin token>).",
        code="invalid_admin_token", headers={"WWW-Authenticate": "Bearer", "Connection": "close"},
    )


def forbidden(message: str, param: str | None = None) -> AdminError:
    return AdminError(403, message, param=param, code="forbidden")


def conflict(message: str) -> AdminError:
    return AdminError(409, message, code="invalid_state")


def internal_error() -> AdminError:
    return AdminError(500, "The server had an internal error.", code="internal_error")


def from_reply(reply: ControlReply) -> AdminError:
    """The engine's error status and message, unchanged."""
    status = reply.status if 400 <= reply.status < 600 else 500
    return AdminError(status, reply.message or f"engine command failed with status {reply.status}",
                      code=reply.data.get("code") if isinstance(reply.data.get("code"), str) else None)
