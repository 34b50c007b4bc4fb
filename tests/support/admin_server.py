"""A real `trillium serve` subprocess with its admin port, for the control-plane tests.

`AdminServer` starts `python -m trillium.cli serve` on free loopback ports
(data plane and admin), waits for both to answer, and offers small httpx
helpers: `admin(method, path, ...)` with the admin token, `complete(...)`
on the data plane with the API key. `start_stream(server, max_tokens)`
runs a streamed greedy completion in a thread (its chunks land in a dict).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import httpx

from support.serve_process import free_port, terminate
from support.waiting import wait_until

API_KEY = "sk-data-plane-key"
ADMIN_TOKEN = "admin-token-for-tests"
MODEL_NAME = "cp-model"
PROMPTS = ["Once upon a time", "The little dog", "She said hello to"]
MAX_TOKENS = 12


def serve_command(model: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trillium.cli", "serve", "--model", model, *extra]


class AdminServer:
    def __init__(self, model: str, *extra: str, env: dict | None = None, admin_token: str = ADMIN_TOKEN) -> None:
        self.port = free_port()
        self.admin_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        self.token = admin_token
        cmd = serve_command(
            model, "--port", str(self.port), "--admin-port", str(self.admin_port),
            "--served-model-name", MODEL_NAME, "--api-key", API_KEY, *extra,
        )
        self.log_path = f"/tmp/trillium-cp-serve-{self.port}.log"
        self._log = open(self.log_path, "wb")
        environment = {**os.environ, "TRILLIUM_ADMIN_TOKEN": admin_token, **(env or {})}
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=environment)
        self.http = httpx.Client(timeout=120)

    def wait_ready(self, timeout_s: float = 180) -> "AdminServer":
        def ready() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"trillium serve exited {self.process.returncode}:\n{self.log()}")
            ok = self.http.get(self.base_url + "/health", timeout=2).status_code == 200
            return ok and self.admin("GET", "/health", timeout=2).status_code == 200

        wait_until(ready, timeout_s=timeout_s, interval_s=0.2, what="trillium serve and its admin port to answer",
                   ignoring=(httpx.HTTPError,), detail=self.log)
        return self

    # -- HTTP helpers -----------------------------------------------------

    def admin(self, method: str, path: str, *, token: str | None = None, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token if token is None else token}", **kwargs.pop("headers", {})}
        return self.http.request(method, self.admin_url + path, headers=headers, **kwargs)

    def admin_ok(self, method: str, path: str, **kwargs) -> dict:
        response = self.admin(method, path, **kwargs)
        assert response.status_code == 200, (path, response.status_code, response.text)
        return response.json()

    def complete(self, prompt: str, max_tokens: int = 12, *, key: str = API_KEY, **extra) -> httpx.Response:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        return self.http.post(self.base_url + "/v1/completions", json=body,
                              headers={"Authorization": f"Bearer {key}"})

    def greedy(self, prompts: list[str], max_tokens: int = 12) -> list[str]:
        texts = []
        for prompt in prompts:
            response = self.complete(prompt, max_tokens)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
        return texts

    # -- teardown ---------------------------------------------------------

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-6000:]

    def stop(self, timeout_s: float = 60) -> int:
        self.http.close()
        return terminate(self.process, self._log, timeout_s)


def _stream(server: AdminServer, max_tokens: int, started: threading.Event, result: dict) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    chunks = result["chunks"] = []
    try:
        with server.http.stream("POST", server.base_url + "/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {API_KEY}"}) as response:
            result["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    started.set()
    finally:
        started.set()


def start_stream(server: AdminServer, max_tokens: int) -> tuple[threading.Thread, dict]:
    """A streamed completion running in a thread, once its first chunk arrived: (thread, result)."""
    started, result = threading.Event(), {}
    thread = threading.Thread(target=_stream, args=(server, max_tokens, started, result), daemon=True)
    thread.start()
    assert started.wait(60)
    return thread, result


def final_reason(result: dict) -> str | None:
    """The last finish_reason a streamed completion reported."""
    reasons = [c["choices"][0]["finish_reason"] for c in result["chunks"] if c["choices"]]
    return next((r for r in reversed(reasons) if r), None)
