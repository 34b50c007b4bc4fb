"""GGUF weight-only matmuls on CPU: the C kernel in gguf_cpu.c, built at first use, called by ctypes.

    matmul(x [M, K] float32, blocks [N, row_bytes] uint8, ggml_type, K, activations=FLOAT32) -> [M, N] float32
    gemm_int8 / fused_int8 / decode_int8(x, blocks, ggml_type, K)   (matmul's int8 kernels, one each: the same bits)
    dequantize(blocks, ggml_type, K) -> [N, K] float32
    available() -> bool        (a C compiler built the kernel here)

Formats: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (ggml type ids 8, 2, 3, 6, 7; blocks of 32 weights) and the
K-quants Q4_K, Q5_K, Q6_K (12, 13, 14; super-blocks of 256), weights in
llama.cpp's own block layout (see the C file's header). With FLOAT32
activations nothing is requantized, so the result equals
dequantize-then-matmul up to float32 summation order. With INT8 (Q8_0 and
Q4_0 .. Q5_1 only) each row of x is first rounded to int8 blocks of 32, as
llama.cpp's Q8_1, and the blocks meet in exact integer dot products (the C
file's "int8 activations" section): llama.cpp's numerics, and faster.

WHY a C file and not torch's weight-only ops: on x86 torch 2.13's
`_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm` vectorize only
bfloat16 activations (their float32 path is the scalar fallback loop), and
neither takes group-wise int8 scales (Q8_0); bfloat16 activations or
per-channel requantization would change the model's numbers. The C kernel
has no torch headers, so it compiles in about a second with the system
compiler, into `local_cache.cache_dir()`/kernels/ (~/.cache/trillium) keyed by the source, the flags and
the CPU's feature flags; nothing is downloaded. Where no compiler is found,
`available()` is False and the loader dequantizes instead (and says so).

NOTE: the kernel's OpenMP threads come from the libgomp torch already
loaded (same soname), so `torch.get_num_threads()` bounds both.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from trillium.kernels.c_library import CLibrary

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
BLOCK_BYTES = {Q8_0: 34, Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q4_K: 144, Q5_K: 176, Q6_K: 210}  # bytes per block
BLOCK_VALUES = {Q8_0: 32, Q4_0: 32, Q4_1: 32, Q5_0: 32, Q5_1: 32, Q4_K: 256, Q5_K: 256, Q6_K: 256}  # weights per block
FORMAT_NAMES = {Q8_0: "Q8_0", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q4_K: "Q4_K", Q5_K: "Q5_K",
                Q6_K: "Q6_K"}
# Activation modes of `matmul`: float32 (exact dequantize-then-matmul) or int8 blocks (llama.cpp's way).
FLOAT32, INT8 = "float32", "int8"
INT8_TYPES = frozenset({Q8_0, Q4_0, Q4_1, Q5_0, Q5_1})  # the formats with an int8-activation kernel
FUSED_MAX_ROWS = 8  # gguf_cpu.c's: matmul's int8 rows take the fused pass up to here, the buffered GEMM above
FUSED_PASSES_MAX_ROWS = 64  # gguf_cpu.c's: what fused_int8 takes, in passes of 8 rows (tests, benches)
BLOCK_SIZE = 32  # the legacy formats' block; K-quant super-blocks are BLOCK_VALUES[t] = 256
_SOURCE = Path(__file__).with_name("gguf_cpu.c")


def _declare(lib: ctypes.CDLL) -> None:
    lib.trillium_gguf_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                         ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
    lib.trillium_gguf_matmul.restype = ctypes.c_int
    lib.trillium_gguf_matmul_q8.argtypes = lib.trillium_gguf_matmul.argtypes
    lib.trillium_gguf_matmul_q8.restype = ctypes.c_int
    lib.trillium_gguf_decode_q8.argtypes = lib.trillium_gguf_matmul.argtypes
    lib.trillium_gguf_decode_q8.restype = ctypes.c_int
    lib.trillium_gguf_gemm_q8.argtypes = lib.trillium_gguf_matmul.argtypes
    lib.trillium_gguf_gemm_q8.restype = ctypes.c_int
    lib.trillium_gguf_fused_q8.argtypes = lib.trillium_gguf_matmul.argtypes
    lib.trillium_gguf_fused_q8.restype = ctypes.c_int
    lib.trillium_gguf_gemm_q8_vectorized.argtypes = []
    lib.trillium_gguf_gemm_q8_vectorized.restype = ctypes.c_int
    lib.trillium_gguf_dequantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                             ctypes.c_void_p, ctypes.c_int]
    lib.trillium_gguf_dequantize.restype = ctypes.c_int


_LIBRARY = CLibrary(_SOURCE, "the GGUF CPU kernel", _declare)


available = _LIBRARY.available  # a C compiler built the kernel here
unavailable_reason = _LIBRARY.unavailable_reason  # why not (None when it built)


def check_activations(activations: str) -> str:
    """`activations` if it is FLOAT32 or INT8, else ValueError."""
    if activations not in (FLOAT32, INT8):
        raise ValueError(f"activations must be {FLOAT32!r} or {INT8!r}, got {activations!r}")
    return activations


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one packed row of K weights."""
    return k // BLOCK_VALUES[ggml_type] * BLOCK_BYTES[ggml_type]


def _check(blocks: torch.Tensor, ggml_type: int, k: int) -> None:
    if ggml_type not in BLOCK_BYTES:
        raise ValueError(f"ggml type {ggml_type} has no packed CPU kernel (have {sorted(FORMAT_NAMES.values())})")
    per = BLOCK_VALUES[ggml_type]
    if k % per or blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
        raise ValueError(f"packed {FORMAT_NAMES[ggml_type]} weights must be contiguous uint8 [N, K/{per} blocks] "
                         f"with K % {per} == 0 (K={k})")
    if blocks.shape[1] != row_bytes(ggml_type, k) or blocks.device.type != "cpu":
        raise ValueError(f"{FORMAT_NAMES[ggml_type]} rows of K={k} are {row_bytes(ggml_type, k)} "
                         f"bytes on the CPU, got {tuple(blocks.shape)} on {blocks.device}")


def _checked(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, k: int) -> tuple[ctypes.CDLL, torch.Tensor]:
    lib = _LIBRARY.get()
    if lib is None:
        raise RuntimeError(f"GGUF CPU kernel unavailable: {unavailable_reason()}")
    _check(blocks, ggml_type, k)
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.device.type != "cpu":
        raise ValueError(f"x must be float32 [M, {k}] on the CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
    return lib, x if x.stride(1) == 1 else x.contiguous()


def _int8_call(fn, x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    if ggml_type not in INT8_TYPES:
        raise ValueError(f"{FORMAT_NAMES[ggml_type]} has no int8-activation kernel "
                         f"(have {', '.join(FORMAT_NAMES[t] for t in sorted(INT8_TYPES))})")
    out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
    rc = fn(ggml_type, x.data_ptr(), x.shape[0], k, x.stride(0), blocks.data_ptr(), blocks.shape[0], out.data_ptr(),
            torch.get_num_threads())
    if rc == -2:
        raise MemoryError(f"int8 activations of {tuple(x.shape)}: allocation failed")
    return out


def matmul(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, k: int, activations: str = FLOAT32) -> torch.Tensor:
    """x [M, K] float32 @ dequantize(blocks)^T -> [M, N] float32.

    `activations` INT8: x quantized to int8 blocks and integer dot products (the C file's
    "int8 activations" section), for the INT8_TYPES only: another type raises ValueError."""
    lib, x = _checked(x, blocks, ggml_type, k)
    if check_activations(activations) == INT8:
        return _int8_call(lib.trillium_gguf_matmul_q8, x, blocks, ggml_type, k)
    out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
    lib.trillium_gguf_matmul(ggml_type, x.data_ptr(), x.shape[0], k, x.stride(0), blocks.data_ptr(),
                             blocks.shape[0], out.data_ptr(), torch.get_num_threads())
    return out


def gemm_int8(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """`matmul(x, blocks, ggml_type, k, INT8)` by the many-row kernel only (the C file's "many rows"
    section), whatever M; `matmul` runs it above FUSED_MAX_ROWS rows where it is vectorized (its fused
    pass, `fused_int8`, up to there). The same bits as
    `decode_int8` (the same integer dots and float operations in the same order), so a row's result
    does not depend on the other rows or on which of the two ran it."""
    lib, x = _checked(x, blocks, ggml_type, k)
    return _int8_call(lib.trillium_gguf_gemm_q8, x, blocks, ggml_type, k)


def decode_int8(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """`matmul(x, blocks, ggml_type, k, INT8)` by the decode kernel only, whatever M (tests, benches)."""
    lib, x = _checked(x, blocks, ggml_type, k)
    return _int8_call(lib.trillium_gguf_decode_q8, x, blocks, ggml_type, k)


def fused_int8(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """`matmul(x, blocks, ggml_type, k, INT8)` by the GEMM's fused passes only (the C file's
    `trillium_gguf_fused_q8`: 8 rows a pass, no packed buffer), for at most FUSED_PASSES_MAX_ROWS rows
    where the GEMM is vectorized; `matmul` runs one pass, up to FUSED_MAX_ROWS rows (tests, benches call
    it alone). The same bits as `gemm_int8` and `decode_int8`."""
    lib, x = _checked(x, blocks, ggml_type, k)
    if not gemm_int8_vectorized() or x.shape[0] > FUSED_PASSES_MAX_ROWS:
        raise ValueError(f"the fused pass takes at most {FUSED_PASSES_MAX_ROWS} rows where AVX-512 VNNI is built, "
                         f"got {x.shape[0]} rows"
                         + ("" if gemm_int8_vectorized() else " (not built here)"))
    return _int8_call(lib.trillium_gguf_fused_q8, x, blocks, ggml_type, k)


@functools.cache
def gemm_int8_vectorized() -> bool:
    """`gemm_int8` has its AVX-512 VNNI path here (else it runs plain loops, slower than dequantize +
    oneDNN, and packed_linear.py keeps that). Fixed once the library is built: asked once."""
    lib = _LIBRARY.get()
    return lib is not None and bool(lib.trillium_gguf_gemm_q8_vectorized())


def dequantize(blocks: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """The float32 [N, K] weights the blocks hold."""
    lib = _LIBRARY.get()
    if lib is None:
        raise RuntimeError(f"GGUF CPU kernel unavailable: {unavailable_reason()}")
    _check(blocks, ggml_type, k)
    out = torch.empty(blocks.shape[0], k, dtype=torch.float32)
    lib.trillium_gguf_dequantize(ggml_type, blocks.data_ptr(), blocks.shape[0], k, out.data_ptr(),
                                 torch.get_num_threads())
    return out
