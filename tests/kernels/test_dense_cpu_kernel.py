"""dense_cpu.c (float32 linear for a few rows) against F.linear, and `llama.linear`'s choice of it.

Rows 1..MAX_ROWS (the one-row path and the tiles of four, a partial tile
included), K with and without a tail after the vector loop, rows of x further
apart than K (a view into a wider buffer), bias or none, and N both below
the kernel's one-thread floor and above it (two threads split the outputs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trillium.kernels import dense_cpu
from trillium.models import llama

pytestmark = pytest.mark.skipif(not dense_cpu.available(), reason=f"no C kernel: {dense_cpu.unavailable_reason()}")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, dense_cpu.MAX_ROWS])
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
