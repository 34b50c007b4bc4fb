"""Shared by the Triton tests: is the NVIDIA backend here, and the env for a compile-only child run."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


def nvidia_backend_present() -> bool:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    return (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


requires_nvidia_backend = pytest.mark.skipif(
    not nvidia_backend_present(), reason="triton (with its NVIDIA backend and ptxas) is not installed"
)


def compile_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a child process that compiles kernels for sm_90 (no interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), **extra)
    return env
