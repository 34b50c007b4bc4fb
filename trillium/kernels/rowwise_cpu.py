"""A decoder layer's row-wise ops in float32 on CPU: rowwise_cpu.c, built at first use, called by ctypes.

    rms_norm(x [..., n], weight [n], eps) -> y | None              (None: not taken, run the reference)
    silu_and_mul(x [T, 2I]) -> y [T, I] | None
    rotary_embedding(positions [T], q [T, H, D], k [T, KH, D], table [P, D]) -> (q, k) | None
    available() -> bool, unavailable_reason() -> str | None

kernels/dispatch.py sends every float32 CPU call here first, eager or in a compiled graph (where
native_ops.cpp calls the same C functions, or dispatch.py's Python twins call these), so a row has one
set of bits whatever ran its step; the C file's header says why. What is taken: float32 CPU tensors,
last dimension contiguous, at most two leading dimensions (one stride each). The results equal the
reference (kernels/reference.py) up to float32 rounding (rope exactly). Calls of 32K elements or
more split their rows across torch.get_num_threads() threads, whole rows each (the C header says
why; the bits do not change). Built like dense_cpu.py
(`-O3 -march=native`, but `-ffp-contract=off`), cached under `local_cache.cache_dir()`/kernels;
where no C compiler is found the reference runs everywhere, eager and compiled alike.
TRILLIUM_KERNELS=reference turns it off (read once, at import).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from trillium.kernels.c_library import FLAGS, CLibrary

_SOURCE = Path(__file__).with_name("rowwise_cpu.c")
_P, _L = ctypes.c_void_p, ctypes.c_long
# WHY no contraction: a product rounded by itself whatever the compiler vectorizes (the C header)
_FLAGS = tuple("-ffp-contract=off" if flag.startswith("-ffp-contract") else flag for flag in FLAGS)


def _declare(lib: ctypes.CDLL) -> None:
    lib.trillium_rms_norm.argtypes = [_P, _L, _L, _L, _L, _L, _P, ctypes.c_float, _P, ctypes.c_int]
    lib.trillium_rms_norm.restype = None
    lib.trillium_silu_and_mul.argtypes = [_P, _L, _L, _L, _P, ctypes.c_int]
    lib.trillium_silu_and_mul.restype = None
    lib.trillium_rope.argtypes = [_P, _L, _L, _L, _L, _L, _P, _P, _L, _P, ctypes.c_int]
    lib.trillium_rope.restype = ctypes.c_int


_LIBRARY = CLibrary(_SOURCE, "the float32 row-wise ops (norm, SiLU, rope)", _declare, flags=_FLAGS,
                    fallback="the torch reference runs them")
available = _LIBRARY.available
unavailable_reason = _LIBRARY.unavailable_reason
_ENABLED = os.environ.get("TRILLIUM_KERNELS", "") != "reference"


def _lib(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library when every tensor is a float32 CPU tensor with a contiguous last dimension."""
    if not _ENABLED:
        return None
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
            return None
    return _LIBRARY.get()


def _rows(x: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(outer, inner, stride_outer, stride_inner) of x's leading dimensions, at most two of them."""
    if x.dim() == 1:
        return 1, 1, 0, 0
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    lib = _lib(x, weight)
    rows = _rows(x)
    if lib is None or rows is None or weight.dim() != 1 or weight.shape[0] != x.shape[-1] or x.numel() == 0:
        return None
    out = torch.empty(x.shape, dtype=torch.float32)
    lib.trillium_rms_norm(x.data_ptr(), *rows[:2], x.shape[-1], *rows[2:], weight.data_ptr(), eps, out.data_ptr(),
                          torch.get_num_threads())
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    lib = _lib(x)
    if lib is None or x.dim() != 2 or x.shape[1] % 2 or x.numel() == 0:
        return None
    inter = x.shape[1] // 2
    out = torch.empty(x.shape[0], inter, dtype=torch.float32)
    lib.trillium_silu_and_mul(x.data_ptr(), x.shape[0], inter, x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    lib = _lib(q, k, table)
    if (lib is None or q.dim() != 3 or k.dim() != 3 or table.dim() != 2 or not table.is_contiguous()
            or q.shape[2] != table.shape[1] or k.shape[2] != table.shape[1] or q.shape[2] % 2
            or positions.dtype != torch.int64 or positions.dim() != 1 or not positions.is_contiguous()
            or positions.device.type != "cpu" or not (positions.shape[0] == q.shape[0] == k.shape[0])):
        return None
    outs = []
    for x in (q, k):
        out = torch.empty(x.shape, dtype=torch.float32)
        if lib.trillium_rope(x.data_ptr(), *x.shape, x.stride(0), x.stride(1), positions.data_ptr(),
                             table.data_ptr(), table.shape[0], out.data_ptr(), torch.get_num_threads()):
            return None  # a position outside the table: the reference's index_select says which
        outs.append(out)
    return outs[0], outs[1]


__all__ = ["available", "rms_norm", "rotary_embedding", "silu_and_mul", "unavailable_reason"]
