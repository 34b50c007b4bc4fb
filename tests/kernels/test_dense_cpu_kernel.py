"""dense_cpu.c (float32 linear for a few rows) against F.linear, and `llama.linear`'s choice of it.

Rows 1..MAX_ROWS (a function per row count up to a tile, more rows in
several tiles, a partial tile included), K with and without a tail after the
vector loop, rows of x further apart than K (a view into a wider buffer), bias or none, and N both below
the kernel's one-thread floor and above it (two threads split the outputs). With the 512-bit tiles
(an Intel CPU with AVX-512) tiles are also 1-3 weight rows wide: N = 7 and 299 end in a 1-wide tile,
300 in a 2-wide one; elsewhere the same tests run the 256-bit tiles.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from trillium.kernels import dense_cpu
from trillium.models import llama

pytestmark = pytest.mark.skipif(not dense_cpu.available(), reason=f"no C kernel: {dense_cpu.unavailable_reason()}")


_ROWS = {r for r in (1, 2, 3, 4, 5, 8, 9, 17) if r <= dense_cpu.MAX_ROWS} | {dense_cpu.MAX_ROWS - 1, dense_cpu.MAX_ROWS}


@pytest.mark.parametrize("rows", sorted(_ROWS))
@pytest.mark.parametrize("k, n", [(512, 1024), (80, 96), (13, 7), (1376, 300)])
def test_matches_f_linear(rows: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + k)
    wide = torch.randn(rows, k + 24, generator=gen)
    x = wide[:, 3 : 3 + k]  # rows k + 24 floats apart, unit stride within a row
    w = torch.randn(n, k, generator=gen) * 0.1
    b = torch.randn(n, generator=gen)
    assert dense_cpu.takes(x, w, b) and x.stride(0) == k + 24
    threads = torch.get_num_threads()
    try:
        for t in {1, 2}:
            torch.set_num_threads(t)
            torch.testing.assert_close(dense_cpu.linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
            torch.testing.assert_close(dense_cpu.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("k, n", [(512, 300), (13, 300), (1376 + 5, 300), (512, 299), (80, 7)])
def test_every_row_count_equals_its_rows_one_at_a_time(k: int, n: int) -> None:
    """Each row count has its own function and tiles of them cover more rows, but a row's arithmetic
    must not depend on how many rows share the call or where it sits: a speculative verify row then
    equals its decode step bit for bit, and a sequence's tokens do not depend on its batch."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(dense_cpu.MAX_ROWS, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.1
    b = torch.randn(n, generator=gen)
    alone = torch.cat([dense_cpu.linear(x[r : r + 1], w, b) for r in range(dense_cpu.MAX_ROWS)])
    threads = torch.get_num_threads()
    try:
        for t in {1, 2}:
            torch.set_num_threads(t)
            for rows in range(1, dense_cpu.MAX_ROWS + 1):
                assert torch.equal(dense_cpu.linear(x[:rows], w, b), alone[:rows]), f"{rows} rows, {t} threads"
    finally:
        torch.set_num_threads(threads)


def test_tile_width_follows_the_cpu() -> None:
    """The 512-bit tiles (and 64 rows) where dense_cpu.py asks for them, the 256-bit ones elsewhere or
    under TRILLIUM_DENSE_TILES=256 (64 rows on AVX2 without AVX-512, 16 beside AVX-512 or without AVX2); the build reports which it
    compiled; another value of the variable is an error, not ignored."""
    from trillium.kernels.c_library import cpu_flags, cpu_vendor

    intel_avx512 = "avx512f" in cpu_flags().split() and cpu_vendor() == "GenuineIntel"
    forced = os.environ.get("TRILLIUM_DENSE_TILES") == "256"
    assert dense_cpu.WIDE == (intel_avx512 and not forced)
    flags = set(cpu_flags().split())
    avx2_only = {"avx2", "fma"} <= flags and "avx512f" not in flags
    assert dense_cpu.MAX_ROWS == (64 if dense_cpu.WIDE or avx2_only else 16)
    assert (dense_cpu.vector_bits() == 512) == dense_cpu.WIDE
    if dense_cpu.WIDE:  # the other build, in a fresh interpreter
        code = "from trillium.kernels import dense_cpu as d; print(d.WIDE, d.MAX_ROWS, d.vector_bits())"
        env = dict(os.environ, TRILLIUM_DENSE_TILES="256")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == ["False", "16", "256"]
    bad = subprocess.run([sys.executable, "-c", "import trillium.kernels.dense_cpu"], capture_output=True, text=True,
                         env=dict(os.environ, TRILLIUM_DENSE_TILES="512"))
    assert bad.returncode != 0 and "TRILLIUM_DENSE_TILES='512': expected 256" in bad.stderr


def test_takes_only_what_it_computes() -> None:
    w = torch.randn(16, 8)
    assert dense_cpu.takes(torch.randn(dense_cpu.MAX_ROWS, 8), w, None)
    assert not dense_cpu.takes(torch.randn(dense_cpu.MAX_ROWS + 1, 8), w, None)  # oneDNN's
    assert not dense_cpu.takes(torch.randn(8, 2).t(), w, None)  # columns not unit stride
    assert not dense_cpu.takes(torch.randn(1, 8), torch.randn(8, 16).t(), None)  # transposed weight
    assert not dense_cpu.takes(torch.randn(1, 1, 8), w, None)  # llama.linear passes 3-D x to oneDNN
    with pytest.raises(ValueError, match="does not fit"):
        dense_cpu.linear(torch.randn(1, 8), torch.randn(16, 9))


def test_llama_linear_runs_it_for_a_few_rows(monkeypatch) -> None:
    calls = []
    real = dense_cpu.linear
    monkeypatch.setattr(dense_cpu, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    w = torch.randn(32, 64)
    with torch.inference_mode():
        for rows in (1, dense_cpu.MAX_ROWS, dense_cpu.MAX_ROWS + 1):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(llama.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert calls == [1, dense_cpu.MAX_ROWS]


def test_compiled_decode_padding_rows_are_skipped() -> None:
    """kernels/padded_rows.py: inside live_rows(n) the float32 linear op computes rows < n (the same
    bits as without the hint) and leaves the padding rows zero; outside the hint every row is computed."""
    from trillium.kernels import padded_rows

    gen = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(8, 64, generator=gen), torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    with torch.inference_mode():
        full = torch.ops.trillium.cpu_linear(x, w, b)
        with padded_rows.live_rows(5):
            skipped = torch.ops.trillium.cpu_linear(x, w, b)
        after = torch.ops.trillium.cpu_linear(x, w, b)
    assert torch.equal(skipped[:5], full[:5]) and not skipped[5:].any()
    assert torch.equal(after, full) and full[5:].abs().sum() > 0
