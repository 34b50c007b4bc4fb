"""Shared pieces of the fault suite: a streaming client in a thread, /metrics samples, leak checks.

`StreamingClient` runs one long streamed completion on a thread and keeps
every SSE `data:` payload it received (decoded), so a test can signal an
engine process mid-stream and then look at how the stream ended. The leak
checks read /proc (engine children still alive) and the server's log (the
ipc socket directory it named at start).
"""

from __future__ import annotations

import json
import re
import threading

import httpx

from support.serve_process import ServeProcess, child_pids, is_alive

MODEL_NAME = "test-model"  # ServeProcess passes --served-model-name test-model


class StreamingClient:
    """One streamed completion on a thread; `events` holds each data payload (dict or "[DONE]")."""

    def __init__(self, server: ServeProcess, max_tokens: int = 30000, prompt: str = "Once upon a time") -> None:
        self.events: list = []
        self.status: int | None = None
        self.error: BaseException | None = None
        self.first_chunk = threading.Event()
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(server.base_url, body), daemon=True)
        self._thread.start()

    def _run(self, base_url: str, body: dict) -> None:
        try:
            with httpx.Client(base_url=base_url, timeout=120) as http:
                with http.stream("POST", "/v1/completions", json=body) as response:
                    self.status = response.status_code
                    for line in response.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        payload = line[len("data: "):]
                        self.events.append(payload if payload == "[DONE]" else json.loads(payload))
                        self.first_chunk.set()
        except BaseException as exc:  # noqa: BLE001 - reported to the test (a cut connection)
            self.error = exc
        finally:
            self.first_chunk.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the stream did not end within {timeout_s} s"

    @property
    def error_event(self) -> dict | None:
        errors = [e for e in self.events if isinstance(e, dict) and "error" in e]
        return errors[-1]["error"] if errors else None

    @property
    def num_tokens(self) -> int:
        return sum(1 for e in self.events if isinstance(e, dict) and "choices" in e)


class NonStreamedClient:
    """One non-streamed completion with n=2 on a thread; `response` once answered (None if cut)."""

    def __init__(self, server: ServeProcess, max_tokens: int = 30000) -> None:
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None
        body = {"model": MODEL_NAME, "prompt": "The little dog", "max_tokens": max_tokens, "ignore_eos": True,
                "n": 2}
        self._thread = threading.Thread(target=self._run, args=(server.base_url, body), daemon=True)
        self._thread.start()

    def _run(self, base_url: str, body: dict) -> None:
        try:
            self.response = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
        except BaseException as exc:  # noqa: BLE001 - reported to the test (a cut connection)
            self.error = exc

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the request did not end within {timeout_s} s"


def metric(server: ServeProcess, name: str, **labels: str) -> float:
    """The value of one sample on the data port's /metrics (labels must match); KeyError if absent."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name}{labels} not on /metrics")


def ipc_dir_of(server: ServeProcess) -> str:
    match = re.search(r"sockets in (\S+)\)", server.log())
    assert match, "the server did not log its socket directory"
    return match.group(1)


def engine_pids(server: ServeProcess) -> dict[str, int]:
    """{actor: pid} of the engine children, from the start-up log line."""
    pids = dict((name, int(pid)) for name, pid in re.findall(r"(executor|detokenizer|scheduler) pid (\d+)",
                                                           server.log()))
    assert set(pids) == {"executor", "detokenizer", "scheduler"}, server.log()
    assert sorted(pids.values()) == sorted(child_pids(server.process.pid))
    return pids


def no_leftovers(pids, ipc_dir: str) -> list[str]:
    """What a stopped server left behind: live engine processes, its socket directory."""
    import os

    left = [f"pid {pid} alive" for pid in pids if is_alive(pid)]
    if os.path.exists(ipc_dir):
        left.append(f"{ipc_dir} still exists: {os.listdir(ipc_dir)}")
    return left
