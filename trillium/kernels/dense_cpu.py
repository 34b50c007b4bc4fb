"""float32 linear layers for a few rows on CPU: dense_cpu.c, built at first use, called by ctypes.

    linear(x [M, K] float32, weight [N, K] float32, bias [N] | None) -> [M, N] float32   (M <= MAX_ROWS)
    takes(x, weight, bias) -> bool        (this kernel runs the call; else the caller's matmul)
    available() -> bool                   (a C compiler built the kernel here)
    WIDE, vector_bits() -> int            (512-bit tiles asked for / the width the build has)

Decode steps of 1..MAX_ROWS tokens are matrix-vector products bound by reading
the weights from memory; the C file's header says why its chunked sequential
walk reads them faster than oneDNN's small-M path. The result equals x @ w.T
up to float32 summation order. Built like gguf_cpu.py (same flags, cached under
`local_cache.cache_dir()`/kernels keyed by source, flags, compiler and CPU
flags; nothing downloaded); where no compiler is found, `available()` is False
and `models/llama.py` keeps oneDNN for every call. TRILLIUM_KERNELS=reference
turns it off (read once, at import). On an Intel CPU with AVX-512 it is built
with 512-bit tiles and takes up to 64 rows (`WIDE`); TRILLIUM_DENSE_TILES=256
keeps the 256-bit tiles and 16 rows. The 256-bit build takes up to 64 rows on an
AVX2 CPU without AVX-512 and 16 on one with it (a Zen 4): `MAX_ROWS` says why.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from trillium.kernels.c_library import FLAGS, CLibrary, cpu_flags, cpu_vendor


def _wide_tiles() -> bool:
    """The 512-bit tiles (dense_cpu.c, TRILLIUM_DENSE_512): an Intel CPU with AVX-512. WHY not every
    AVX-512 CPU: Zen 4 splits 512-bit ops in two, and there the 256-bit tiles ran faster (the C file's
    notes). TRILLIUM_DENSE_TILES=256 keeps the 256-bit tiles anywhere (for a side-by-side run);
    any other value than 256 or auto is refused, not ignored."""
    asked = os.environ.get("TRILLIUM_DENSE_TILES", "auto")
    if asked not in ("auto", "256"):
        raise ValueError(f"TRILLIUM_DENSE_TILES={asked!r}: expected 256 (the 256-bit tiles) or auto (unset)")
    if asked == "256":
        return False
    flags = cpu_flags().split()
    return "avx512f" in flags and cpu_vendor() == "GenuineIntel"


WIDE = _wide_tiles()
# Rows (tokens) up to which a float32 CPU linear runs here: decode batches and verify steps.
# Measured against oneDNN on the bench model's shapes (bench/dense_linear.py); above this many rows
# the weights are reused enough that oneDNN's blocked kernel wins. 64 with the 512-bit tiles (the C
# file has the figures) and on a CPU without AVX-512, where oneDNN's kernels are 256-bit too: on the
# 2-core AMD EPYC (Zen 3, AVX2) the bench model's 33 linears at 2 threads took 13.1 / 17.7 / 20.6 /
# 31.4 / 39.9 ms at 16 / 24 / 32 / 48 / 64 rows against oneDNN's 18.9 / 21.8 / 23.6 / 35.2 / 42.6, and
# 58.8 against 55.2 at 96; in process, the decode of 64 requests at once took 9.6-10.5 s against
# 11.8-13.5 (the parent commit, alternated; oneDNN's 17-64-row calls left each thread ~half its time
# in libgomp's waits). 16 with the 256-bit tiles on a CPU that also has AVX-512 (a Zen 4: there the
# tiles tied oneDNN at 16 rows and 17-64 rows were not measured again), and 16 where the build has
# no vector tiles at all (no AVX2 and FMA: plain loops, no match for oneDNN past a few rows).
_CPU_FLAGS = set(cpu_flags().split())
MAX_ROWS = 64 if WIDE or ({"avx2", "fma"} <= _CPU_FLAGS and "avx512f" not in _CPU_FLAGS) else 16
_SOURCE = Path(__file__).with_name("dense_cpu.c")


def _declare(lib: ctypes.CDLL) -> None:
    lib.trillium_f32_linear.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                        ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int]
    lib.trillium_f32_linear.restype = ctypes.c_int
    lib.trillium_f32_linear_vector_bits.argtypes = []
    lib.trillium_f32_linear_vector_bits.restype = ctypes.c_int


_LIBRARY = CLibrary(_SOURCE, "the float32 small-batch linear kernel", _declare,
                    flags=FLAGS + (("-DTRILLIUM_DENSE_512",) if WIDE else ()))
available = _LIBRARY.available
unavailable_reason = _LIBRARY.unavailable_reason
_ENABLED = os.environ.get("TRILLIUM_KERNELS", "") != "reference"


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Does this kernel run `linear(x, weight, bias)`? (float32 CPU tensors, x [M <= MAX_ROWS, K]
    with unit stride in its rows, contiguous weight; cheap tests first: it runs per layer per step)"""
    return _ENABLED and fits(x, weight, bias) and _LIBRARY.get() is not None


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """`takes`' tests of the shapes alone (traceable: trillium_native::cpu_linear's callers ask at trace time)."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.stride(1) == 1
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) -> [M, N] float32 (call when `takes` says so)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of {tuple(weight.shape)}")
    out = torch.empty(m, n, dtype=torch.float32)
    rc = _LIBRARY.get().trillium_f32_linear(
        x.data_ptr(), m, k, x.stride(0), weight.data_ptr(), n, None if bias is None else bias.data_ptr(),
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"the float32 linear kernel refused x {tuple(x.shape)} @ w {tuple(weight.shape)}")
    return out


def vector_bits() -> int:
    """The built kernel's vector width: 512 (WIDE), 256, or 0 (plain loops; no library: 0)."""
    lib = _LIBRARY.get()
    return 0 if lib is None else lib.trillium_f32_linear_vector_bits()


__all__ = ["MAX_ROWS", "WIDE", "available", "fits", "linear", "takes", "unavailable_reason", "vector_bits"]
