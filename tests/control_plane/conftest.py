"""One `trillium serve` (data plane + admin port) shared by the control-plane tests.

Checkpoints live under one weights root that the server may load from
(--allowed-weight-paths): "base" (the served one, seed 0) and "next"
(seed 1: different greedy outputs). "outside" is a checkpoint outside it.
Greedy references come from `trillium.LLM` on each checkpoint.

Tests that change the served weights put "base" back before they end
(`restore_base`), so test files do not depend on each other's order.
"""

from __future__ import annotations

import os

import pytest

from support.admin_server import MAX_TOKENS, PROMPTS, AdminServer
from trillium import LLM, SamplingParams
from trillium.models.synthetic import build_checkpoint


@pytest.fixture(scope="session")
def weights_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp-weights")
    build_checkpoint(root / "base", "llama", seed=0)
    build_checkpoint(root / "next", "llama", seed=1)
    outside = tmp_path_factory.mktemp("cp-outside")
    build_checkpoint(outside / "ckpt", "llama", seed=2)
    os.symlink(outside / "ckpt", root / "escape")  # a link inside the root to a checkpoint outside it
    return root


@pytest.fixture(scope="session")
def references(weights_root):
    """{"base": [...], "next": [...]}: greedy texts of PROMPTS on each checkpoint."""
    refs = {}
    for name in ("base", "next"):
        with LLM(str(weights_root / name), kv_cache_memory="16MiB") as llm:
            outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
        refs[name] = [o.outputs[0].text for o in outputs]
    assert refs["base"] != refs["next"]
    return refs


@pytest.fixture(scope="session")
def server(weights_root, tmp_path_factory):
    profile_dir = tmp_path_factory.mktemp("cp-profiles")
    proc = AdminServer(
        str(weights_root / "base"), "--allowed-weight-paths", str(weights_root),
        "--profile-dir", str(profile_dir), "--kv-cache-memory", "16MiB", "--max-num-seqs", "32",
    ).wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def restore_base(server, weights_root):
    """Serve "base" again (and resume / wake) after the test, whatever it did."""
    yield
    server.admin("POST", "/resume")
    if server.admin_ok("GET", "/is_sleeping")["is_sleeping"]:
        server.admin_ok("POST", "/wake_up")
    server.admin_ok("POST", "/update_weights_from_disk", json={"model_path": str(weights_root / "base")})
