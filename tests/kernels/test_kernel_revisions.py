"""trillium/benchmarks/revisions.py: a kernel's C source at a git revision, built as a benchmark's baseline.

`bench/dense_linear.py --against REV` and `bench/paged_decode_attention.py --against REV` rest on it:
the old file is read from git, built beside today's, and swapped in for the duration of a `using`
block only.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from trillium.benchmarks.revisions import library_at, using
from trillium.kernels import dense_cpu


def _in_a_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    probe = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(dense_cpu.__file__).parent, capture_output=True)
    return probe.returncode == 0


pytestmark = [
    pytest.mark.skipif(not _in_a_checkout(), reason="not a git checkout"),
    pytest.mark.skipif(not dense_cpu.available(), reason="no C compiler for the kernel"),
]


def test_the_revision_runs_inside_using_and_only_there() -> None:
    old = library_at(dense_cpu, "HEAD")
    assert old.available() and old.source != dense_cpu._SOURCE and old.source.name == dense_cpu._SOURCE.name
    today = dense_cpu._LIBRARY
    x, w = torch.randn(5, 40), torch.randn(24, 40)
    with using(dense_cpu, old):
        assert dense_cpu._LIBRARY is old
        got = dense_cpu.linear(x, w)
    assert dense_cpu._LIBRARY is today
    torch.testing.assert_close(got, x @ w.T, atol=1e-4, rtol=1e-5)


def test_an_unknown_revision_is_a_clear_error() -> None:
    with pytest.raises(SystemExit, match="--against no-such-rev: cannot read dense_cpu.c"):
        library_at(dense_cpu, "no-such-rev")
