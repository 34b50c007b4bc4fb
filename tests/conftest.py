"""Shared fixtures: synthetic checkpoints built once per session, one torch thread."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from trillium.models.synthetic import build_checkpoint


def pytest_configure(config):
    """The run's own cache dir (GGUF tokenizers converted once, gguf_tokenizer_cache.py): never the
    user's ~/.cache, and shared by every server the tests start (they inherit the environment)."""
    if "TRILLIUM_CACHE_DIR" not in os.environ:
        os.environ["TRILLIUM_CACHE_DIR"] = tempfile.mkdtemp(prefix="trillium-test-cache-")
    # The one switch for compiled decode (trillium/config.py ENFORCE_EAGER_ENV): every engine the
    # tests start runs eager (compiling costs seconds per bucket) unless it passes enforce_eager=False.
    os.environ.setdefault("TRILLIUM_ENFORCE_EAGER", "1")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(variant, **kwargs) -> Path, built once per distinct arguments."""
    built: dict[tuple, Path] = {}

    def get(variant: str, **kwargs) -> Path:
        key = (variant, tuple(sorted(kwargs.items())))
        if key not in built:
            root = tmp_path_factory.mktemp(f"ckpt-{variant}")
            built[key] = build_checkpoint(root, variant, **kwargs)
        return built[key]

    return get


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Run these tests on one intra-op thread, restoring the setting afterwards.

    WHY: on a small shared CI box, OpenMP threads of tiny matmuls spin against
    each other and other processes; one thread is ~100x faster here.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
