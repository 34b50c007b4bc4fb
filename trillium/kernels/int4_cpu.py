"""Group-wise int4 weight-only matmuls on CPU (AWQ / GPTQ): int4_cpu.c, built at first use, called by ctypes.

    matmul(x [M, K] float32, qs [N, K/2] uint8, sz [N, K/group, 2] float32, group) -> [M, N] float32
    dequantize(qs, sz, group) -> [N, K] float32
    available() -> bool        (a C compiler built the kernel here)

The layout (see the C file's header) is the one `int4_checkpoint.py`
repacks AWQ's and GPTQ's int32 words into at load: nibbles row-major per
output channel, and per group the pair (s, -z * s). The result equals
dequantize-then-matmul up to float32 summation order.

WHY our own kernel and not torch's `_weight_int4pack_mm_for_cpu`: on this
machine (torch 2.13, x86 with AVX-512) it took 16.9 ms with float32 and
16.2 ms with bfloat16 activations for a [1, 2048] x [2048, 2048] weight,
twice oneDNN's float32 matmul of the same (8.1 ms, the machine loaded):
its float32 path is the scalar fallback and bfloat16 activations would
change the model's numbers. Built like gguf_cpu.py (same flags, cached
under `local_cache.cache_dir()`/kernels keyed by source, flags, compiler
and CPU flags; nothing downloaded); where no compiler is found,
`available()` is False and the loader dequantizes instead (and says so).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from trillium.kernels.c_library import CLibrary

CHUNK = 32  # inputs per 16-byte chunk of nibbles; a group is a whole number of chunks
_SOURCE = Path(__file__).with_name("int4_cpu.c")


def _declare(lib: ctypes.CDLL) -> None:
    lib.trillium_int4_matmul.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                         ctypes.c_void_p, ctypes.c_int]
    lib.trillium_int4_matmul.restype = ctypes.c_int
    lib.trillium_int4_dequantize.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                             ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
    lib.trillium_int4_dequantize.restype = ctypes.c_int


_LIBRARY = CLibrary(_SOURCE, "the int4 CPU kernel", _declare)


available = _LIBRARY.available  # a C compiler built the kernel here
unavailable_reason = _LIBRARY.unavailable_reason  # why not (None when it built)


def check_packed(qs: torch.Tensor, sz: torch.Tensor, group: int) -> int:
    """K of a valid (qs, sz) pair for `group`, else ValueError naming what is wrong."""
    if qs.dtype != torch.uint8 or qs.dim() != 2 or not qs.is_contiguous() or qs.device.type != "cpu":
        raise ValueError(f"qs must be contiguous uint8 [N, K/2] on the CPU, got {qs.dtype} {tuple(qs.shape)}")
    k = qs.shape[1] * 2
    if group <= 0 or group % CHUNK or k % group:
        raise ValueError(f"group size {group} must be a multiple of {CHUNK} dividing K={k}")
    want = (qs.shape[0], k // group, 2)
    if sz.dtype != torch.float32 or tuple(sz.shape) != want or not sz.is_contiguous() or sz.device.type != "cpu":
        raise ValueError(f"sz must be contiguous float32 {want} on the CPU, got {sz.dtype} {tuple(sz.shape)}")
    return k


def _lib_or_raise() -> ctypes.CDLL:
    lib = _LIBRARY.get()
    if lib is None:
        raise RuntimeError(f"int4 CPU kernel unavailable: {unavailable_reason()}")
    return lib


def matmul(x: torch.Tensor, qs: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] float32 @ dequantize(qs, sz)^T -> [M, N] float32."""
    lib = _lib_or_raise()
    k = check_packed(qs, sz, group)
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.device.type != "cpu":
        raise ValueError(f"x must be float32 [M, {k}] on the CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], qs.shape[0], dtype=torch.float32)
    lib.trillium_int4_matmul(x.data_ptr(), x.shape[0], k, x.stride(0), qs.data_ptr(), sz.data_ptr(),
                             qs.shape[0], group, out.data_ptr(), torch.get_num_threads())
    return out


def dequantize(qs: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """The float32 [N, K] weights (qs, sz) hold."""
    lib = _lib_or_raise()
    k = check_packed(qs, sz, group)
    out = torch.empty(qs.shape[0], k, dtype=torch.float32)
    lib.trillium_int4_dequantize(qs.data_ptr(), sz.data_ptr(), qs.shape[0], k, group, out.data_ptr(),
                                 torch.get_num_threads())
    return out
