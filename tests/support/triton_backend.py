"""Shared by the Triton tests: is the NVIDIA backend here, and the environment of a child run.

Several kernel tests run a test file again as a script (`python tests/kernels/<file>.py`)
so that Triton is imported fresh, with or without TRITON_INTERPRET. `script_env` is that
child's environment; `compile_env` adds a private compile cache for the sm_90 builds.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS_ROOT = REPO_ROOT / "tests"


def nvidia_backend_present() -> bool:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return False
    return (Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


requires_nvidia_backend = pytest.mark.skipif(
    not nvidia_backend_present(), reason="triton (with its NVIDIA backend and ptxas) is not installed"
)


def script_env(**extra: str) -> dict[str, str]:
    """os.environ for a test file run as a script, with this checkout and tests/ first on PYTHONPATH.

    WHY: a script's sys.path starts at its own folder, so without this the child would
    import an installed `trillium` (not this checkout's) and could not import `support`.
    """
    inherited = os.environ.get("PYTHONPATH", "")
    python_path = os.pathsep.join(p for p in (str(REPO_ROOT), str(TESTS_ROOT), inherited) if p)
    return {**os.environ, "PYTHONPATH": python_path, **extra}


def compile_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a child process that compiles kernels for sm_90 (no interpreter)."""
    env = {k: v for k, v in script_env().items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), **extra)
    return env
