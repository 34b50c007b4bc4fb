"""Errors of the admin API, in the data plane's wire shape, rendered once in app.py.

    {"error": {"message": str, "type": str, "param": str | None, "code": str | int | None},
     "success": false, "message": str}

The last two are SGLang's failure fields (its admin routes answer
`{"success": false, "message": ...}`), so a client written for SGLang that
reads `success` sees a failure, not a KeyError.

The response itself is `trillium.http_errors.HttpError`, shared with the
data plane; `AdminError` picks the `type` from the status. `from_reply` turns an engine `ControlReply`
whose status is an error (400 / 403 / 409 / 500 / 504) into the same
status on the wire, with the engine's message.
"""

from __future__ import annotations

from trillium.actors.protocol.admin import ControlReply
from trillium.http_errors import HttpError

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


class AdminError(HttpError):
    """An admin error response; its `type` follows from the status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        kind = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        super().__init__(status, message, type=kind, param=param, code=code, headers=headers)

    def body(self) -> dict:
        return {**super().body(), "success": False, "message": self.message}


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
