"""Errors in OpenAI's wire shape, raised anywhere in a route, rendered once in app.py.

    {"error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}

`ApiError` carries the HTTP status and the body; routes raise it and the
app's error handler turns it into a JSON response. `from_value_error` maps
the ValueErrors of `trillium.validation.check_request` and
`SamplingParams.validate` (which name the bad parameter) onto a 400 with
`param` filled in, so bad input never reaches the 500 path.
"""

from __future__ import annotations

import re

from trillium.actors.protocol.vocabulary import QUEUE_TIMEOUT_REASON
from trillium.http_errors import HttpError

INVALID_REQUEST = "invalid_request_error"

# "invalid sampling parameter 'top_p': ..." (SamplingParams.validate) or
# "max_tokens: ..." (check_request).
_QUOTED_PARAM = re.compile(r"^invalid sampling parameter '(\w+)'")
_PREFIX_PARAM = re.compile(r"^(\w+):")


class ApiError(HttpError):
    """A data-plane error response; `type` defaults to invalid_request_error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status, message, type=type, param=param, code=code, headers=headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def param_of(error: ValueError) -> str | None:
    """The parameter a validation ValueError names, if any."""
    text = str(error)
    match = _QUOTED_PARAM.match(text) or _PREFIX_PARAM.match(text)
    return match.group(1) if match else None


def from_value_error(error: ValueError, rename: dict[str, str] | None = None) -> ApiError:
    """400 for a validation ValueError; `rename` maps engine names to wire names
    (e.g. prompt -> messages for chat, logprobs -> top_logprobs)."""
    param = param_of(error)
    if param is not None and rename:
        param = rename.get(param, param)
    return bad_request(str(error), param)


def model_not_found(name: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{name}` does not exist.",
        param="model",
        code="model_not_found",
    )


def unauthorized() -> ApiError:
    # WHY Connection: close: the refused body may not have been read (app.py).
    return ApiError(
        401,
        "Incorrect API key provided.",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer", "Connection": "close"},
    )


def overloaded(retry_after_s: int) -> ApiError:
    return ApiError(
        503,
        "The server is overloaded: too many requests in flight. Retry later.",
        type="server_overloaded",
        code="server_overloaded",
        headers={"Retry-After": str(retry_after_s)},
    )


def rejection_error(reason: str) -> ApiError:
    """The error for an engine request the engine refused (`Choice.rejection`): 503 +
    Retry-After when it waited past --max-queue-time-s, else a 400 (bad input)."""
    if reason.startswith(QUEUE_TIMEOUT_REASON):
        return ApiError(503, f"The request waited too long in the queue ({reason}). Retry later.",
                        type="server_overloaded", code="queue_timeout", headers={"Retry-After": "1"})
    return bad_request(reason)


def unavailable(retry_after_s: int) -> ApiError:
    return ApiError(
        503,
        "The engine is not available (unhealthy or shutting down). Retry later.",
        type="service_unavailable",
        code="engine_unavailable",
        headers={"Retry-After": str(retry_after_s)},
    )


def engine_not_ready(engine_state: str, retry_after_s: int) -> ApiError:
    """503 while the engine sleeps, is paused or loads new weights."""
    return ApiError(
        503,
        f"The engine is not serving requests right now (state: {engine_state}). Retry later.",
        type="service_unavailable",
        code=f"engine_{engine_state}",
        headers={"Retry-After": str(retry_after_s)},
    )


def engine_failed(reason: str) -> ApiError:
    """503 for a request the engine stopped serving mid-way (an actor died or stalled)."""
    return ApiError(503, f"The engine failed while serving this request: {reason}", type="service_unavailable",
                    code="engine_failed", headers={"Retry-After": "1"})


def internal_error() -> ApiError:
    return ApiError(500, "The server had an internal error.", type="server_error", code="internal_error")
