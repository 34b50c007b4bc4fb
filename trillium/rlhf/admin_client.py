"""A small synchronous client of the admin API (stdlib only: the trainer's side).

    admin = AdminClient("http://127.0.0.1:8001", token)
    admin.post("/pause", {"mode": "keep"}); admin.get("/weight_version")

Every non-2xx answer raises `AdminRequestError` with the status and the
server's error message. Used by `WeightSync`; handy on its own for
sleep / wake / pause / resume around rollouts.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

DEFAULT_TIMEOUT_S = 600.0


class AdminRequestError(RuntimeError):
    """The admin API answered with an error status."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.body = body


class AdminClient:
    def __init__(self, admin_url: str, token: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.admin_url = admin_url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        data: bytes | None = None,
        params: dict[str, Any] | None = None,
        content_type: str = "application/json",
        timeout_s: float | None = None,
    ) -> Any:
        url = self.admin_url + path
        if params:
            query = {k: _query_value(v) for k, v in params.items() if v is not None}
            url += "?" + urllib.parse.urlencode(query)
        if json_body is not None:
            data = json.dumps(json_body).encode()
        headers = {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as error:
            raw = error.read()
            body = _parse(raw)
            message = body.get("error", {}).get("message") if isinstance(body, dict) else None
            raise AdminRequestError(error.code, message or raw.decode(errors="replace") or error.reason,
                                    body) from None
        return _parse(raw)

    def get(self, path: str, **kwargs) -> Any:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, body: Any = None, **kwargs) -> Any:
        return self.request("POST", path, json_body=body if body is not None else {}, **kwargs)

    # -- the lifecycle calls a trainer makes around a rollout -------------

    def sleep(self, level: int = 1, mode: str = "abort") -> Any:
        return self.post("/sleep", {"level": level, "mode": mode})

    def wake_up(self, tags: list[str] | None = None) -> Any:
        return self.post("/wake_up", {"tags": tags} if tags else {})

    def pause(self, mode: str = "abort") -> Any:
        return self.post("/pause", {"mode": mode})

    def resume(self) -> Any:
        return self.post("/resume")

    def is_paused(self) -> bool:
        return bool(self.get("/is_paused")["is_paused"])

    def weight_version(self) -> str:
        return str(self.get("/weight_version")["weight_version"])


def _query_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _parse(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
