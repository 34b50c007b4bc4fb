"""Compiled decode's padding rows, told to the CPU linears so they skip them.

    with live_rows(n): graph(ids_padded, positions_padded)   # rows n.. of every activation are padding
    live() -> int | None                                     # inside: n; elsewhere None
    skip_padding(x, out_features, kernel) -> kernel(x), only rows < live() computed, the rest zero

WHY: a compiled decode graph has one static shape per bucket (1, 2, 4, 8 rows by default), so a
step of 3 tokens -- a batch of 3, or a speculative verify step of a token and two drafts -- runs
the 4-row graph. Row-wise ops cost nothing extra there, but the packed GGUF matmuls do arithmetic
per row (a 5-row verify step padded to 8 paid 8 rows' FMAs: 205 against 128 us per SmolLM2
projection, 1 thread). The padding rows' outputs are discarded (compiled_decode.py returns
hidden[:n]) and the attention op already skips them, so their projections may be zeros.

The float32 linears (`trillium::cpu_linear`: dense_cpu.c, whose cost grows with rows as well:
512x1536, 1 thread, ~150 us at 1 row, ~300 at 8) read it too, in `models/llama._cpu_linear`.

The hint is per thread (each engine runs its forward on its own thread) and only set around a
compiled graph's call; eager forwards never see one, so `live()` is None there. Readers:
`models/packed_linear.py` and `models/llama._cpu_linear`, and native_ops.cpp's linears (the hint
is copied into a C++ thread-local there).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from trillium.kernels import native_ops

_STATE = threading.local()


@contextlib.contextmanager
def live_rows(n: int) -> Iterator[None]:
    previous = getattr(_STATE, "rows", None)
    _STATE.rows = n
    native_ops.set_live_rows(n)  # the C++ linears' copy of the hint (native_ops.py)
    try:
        yield
    finally:
        _STATE.rows = previous
        native_ops.set_live_rows(previous)


def live() -> int | None:
    return getattr(_STATE, "rows", None)


def skip_padding(x: torch.Tensor, out_features: int, kernel: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """kernel(x) [M, ..., out_features] for x [M, ..., K], computing only the live rows (along the
    first dimension) when a hint says fewer than M are (the rest of the result is zero)."""
    n = live()
    if n is None or n >= x.shape[0]:
        return kernel(x)
    out = x.new_zeros(*x.shape[:-1], out_features)
    out[:n] = kernel(x[:n])
    return out
