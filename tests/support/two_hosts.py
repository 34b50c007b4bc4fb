"""Two "hosts" on loopback: a `trillium serve --headless` process beside an api `AdminServer`.

Shared by the multi-node TP test (tests/e2e/test_serve_multi_node.py: node 1
runs executor rank 1) and the remote data-parallel test
(tests/e2e/test_serve_dp_remote.py: the headless host runs replica 1). Both
hosts read the same `--link-secret-file`; the headless one starts first, its
output goes to `log_path`, and on the way out it gets SIGTERM (if the test
left it alive) once the api has stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from support.admin_server import AdminServer


def link_secret_file(directory: Path) -> Path:
    """A fresh --link-secret-file in `directory`: 64 hex digits, mode 600 (as `trillium serve` requires)."""
    secret = directory / "link-secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    secret.chmod(0o600)
    return secret


@contextlib.contextmanager
def headless_beside(model_path, common: list[str], headless_args: list[str], head_args: list[str], log_path: str):
    """Yield the api host's AdminServer (ready), `.headless` the headless host's Popen,
    `.headless_log` its log path; after the block `.exit_code` is the api's exit code."""
    with open(log_path, "wb") as log:
        headless = subprocess.Popen(
            [sys.executable, "-m", "trillium.cli", "serve", "--model", str(model_path), *common, *headless_args,
             "--headless"], stdout=log, stderr=subprocess.STDOUT)
    head = AdminServer(str(model_path), *common, *head_args)
    head.headless, head.headless_log = headless, log_path
    try:
        head.wait_ready(timeout_s=300)
        yield head
    finally:
        head.exit_code = head.stop()
        if headless.poll() is None:
            headless.send_signal(signal.SIGTERM)
        headless.wait(timeout=60)


def headless_log(deployment) -> str:
    """The last 4000 characters of the headless host's output."""
    with open(deployment.headless_log, "rb") as f:
        return f.read().decode(errors="replace")[-4000:]
