"""Runs the Triton-vs-reference cases under TRITON_INTERPRET=1 in a fresh process.

WHY a subprocess: Triton reads TRITON_INTERPRET once, when it is imported.
In one pytest process some other test may already have imported triton in
compiled mode (or may need it that way), so setting the variable here would
be order-dependent. A child pytest over `kernels_interpret_cases.py` always
starts clean.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("kernels_interpret_cases.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_match_reference_in_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", TRILLIUM_KERNELS="")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", str(CASES)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = (proc.stdout + proc.stderr)[-6000:]
    if proc.returncode == 0 and " passed" not in proc.stdout:
        pytest.skip(f"interpreter cases skipped:\n{report}")
    assert proc.returncode == 0, f"interpreter cases failed (rc={proc.returncode}):\n{report}"
