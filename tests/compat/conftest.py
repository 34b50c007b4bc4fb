"""The server every tests/compat module replays its framework against: one
`trillium serve --admin-on-data-port` per module over the module's own
base / next checkpoints. A module sets `SERVE_ENV` for extra environment
(prime-rl: the admin token its client sends as its API key)."""

from __future__ import annotations

import pytest

from support.replay import start_server, weights_root


@pytest.fixture(scope="module")
def root(request, tmp_path_factory):
    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    return weights_root(tmp_path_factory.mktemp(f"{name}-weights"))


@pytest.fixture(scope="module")
def server(request, root):
    env = getattr(request.module, "SERVE_ENV", None)
    proc = start_server(root, "--admin-on-data-port", env=env)
    yield proc
    assert proc.stop() == 0, proc.log()
