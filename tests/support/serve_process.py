"""Start a real `trillium serve` subprocess on a loopback port (test helper)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx

from support.waiting import wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of pid (from /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            children.append(int(entry))
    return children


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class ServeProcess:
    def __init__(self, model: str, *extra: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        # WHY a free admin port: the default (8001) would clash between servers running at once.
        self.admin_port = free_port()
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        admin = [] if "--admin-port" in extra else ["--admin-port", str(self.admin_port)]
        cmd = [sys.executable, "-m", "trillium.cli", "serve", "--model", model,
               "--port", str(self.port), "--served-model-name", "test-model", *admin, *extra]
        self.log_path = f"/tmp/trillium-serve-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})

    def wait_healthy(self, timeout_s: float = 120) -> "ServeProcess":
        def healthy() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"trillium serve exited {self.process.returncode}:\n{self.log()}")
            return httpx.get(self.base_url + "/health", timeout=2).status_code == 200

        wait_until(healthy, timeout_s=timeout_s, interval_s=0.1, what="trillium serve to be healthy",
                   ignoring=(httpx.HTTPError,), detail=self.log)
        return self

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def stop(self, timeout_s: float = 60) -> int:
        return terminate(self.process, self._log, timeout_s)


def terminate(process: subprocess.Popen, log_file, timeout_s: float = 60) -> int:
    """SIGTERM a server process (if still running), wait for it, close its log; its exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout_s)
    finally:
        log_file.close()
