"""trillium/benchmarks/revisions.py: a kernel's C source at a git revision, built as a benchmark's baseline.

`bench/dense_linear.py --against REV` and `bench/paged_decode_attention.py --against REV` rest on it:
the old file is read from git, built beside today's, and swapped in for the duration of a `using`
block only. The revision used is the one before dense_cpu.c summed 8 outputs across lanes at once
(same tree, so the same bits): a different file, a different build, the same results.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from trillium.benchmarks.revisions import library_at, using
from trillium.kernels import dense_cpu

_BEFORE_REDUCE_8 = "c5ba155"


def _has(rev: str) -> bool:
    if shutil.which("git") is None:
        return False
    probe = subprocess.run(["git", "cat-file", "-e", f"{rev}^{{commit}}"], cwd=Path(dense_cpu.__file__).parent,
                           capture_output=True)
    return probe.returncode == 0


pytestmark = [
    pytest.mark.skipif(not _has(_BEFORE_REDUCE_8), reason=f"not a git checkout with {_BEFORE_REDUCE_8}"),
    pytest.mark.skipif(not dense_cpu.available(), reason="no C compiler for the kernel"),
]


def test_the_revision_runs_inside_using_and_only_there() -> None:
    old = library_at(dense_cpu, _BEFORE_REDUCE_8)
    assert old.source.read_bytes() != dense_cpu._SOURCE.read_bytes() and old.source.name == dense_cpu._SOURCE.name
    today = dense_cpu._LIBRARY
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(13, 40, generator=gen), torch.randn(24, 40, generator=gen), torch.randn(24, generator=gen)
    with using(dense_cpu, old):
        assert dense_cpu._LIBRARY is old
        got = dense_cpu.linear(x, w, b)
    assert dense_cpu._LIBRARY is today
    assert torch.equal(got, dense_cpu.linear(x, w, b))  # another build, the same bits
    torch.testing.assert_close(got, x @ w.T + b, atol=1e-4, rtol=1e-5)


def test_an_unknown_revision_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="cannot read dense_cpu.c at no-such-rev"):
        library_at(dense_cpu, "no-such-rev")
