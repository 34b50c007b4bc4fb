"""The error response both HTTP planes send, in OpenAI's wire shape:

    {"error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}

Lives outside data_plane/ and control_plane/ (like http_serving.py) so both
planes share it without importing each other. Each plane subclasses
`HttpError` with its own default `type` (data_plane/errors.py ApiError,
control_plane/errors.py AdminError).
"""

from __future__ import annotations

import json

from quart import Response


class HttpError(Exception):
    """An error response: status, error body, optional extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
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
