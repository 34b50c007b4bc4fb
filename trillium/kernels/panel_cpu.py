"""float32 linears past dense_cpu's rows, on weights packed once into panels (panel_cpu.c).

    takes(x, weight, bias) -> bool      does this kernel run it? (see below; cheap: per layer per step)
    linear(x [M, K], weight [N, K], bias [N] | None) -> [M, N] float32   (call when `takes` says so)
    ENABLED                             TRILLIUM_PANEL_LINEAR (1, the default, or 0), read once at import
    available() / unavailable_reason()  the build (AVX-512F CPUs that are not Intel's only)

`models/llama.py` sends a float32 CPU linear of more than dense_cpu.MAX_ROWS rows here (decode
batches past dense_cpu's reach, prefill chunks) instead of oneDNN (kernels/onednn_packed.py), where
the weight is a parameter and the CPU has AVX-512F and is not Intel's (a Zen 4). WHY: on the 2-core
AMD EPYC (Zen 4) we benchmark on, the bench model's 33 linears at 2 threads (110 MB of weights, read
from memory as a decode step reads them) ran at 126-165 GFLOP/s through oneDNN on its packed copy at 16-64 rows and
160-195 here (bench/dense_linear.py's panel column; the C file says how). From ~128 rows the two
are level alone (1024-2048 rows: 191-192 against 198 GFLOP/s; 7B-sized 4096 x 4096 / 11008 x 4096 /
4096 x 11008 weights at 32-2048 rows: within 4% either way), and served, where the server's other
processes share the two cores, this kernel's dynamic split ran the all64 prompts' prefill 1.04-1.06x
and the whole all64 workload 1.10x oneDNN's (README: "Panel-packed float32 linears").

Only measured on a Zen 4: it is not used on a CPU without AVX-512F (an AVX2 machine keeps dense_cpu.c's
tiles to 64 rows, then oneDNN, as before) nor on an Intel one with it (not measured there, where
512-bit FMAs run at full width and oneDNN reached ~333 GFLOP/s on large products: dense_cpu.c's
512-bit tiles to 64 rows, then oneDNN, as before).

The panels are a copy of the weight kept in onednn_packed's cache (`copy_of(weight, "panel", ...)`),
so the same INVARIANT holds: every place that changes or drops weights calls `onednn_packed.forget()`,
a copy is made again when its weight moved, changed shape or version, and goes with its parameter.
Memory: a second copy of each float32 linear parameter that runs more than dense_cpu.MAX_ROWS rows,
in place of oneDNN's (made at its first such call; sleep level 2 drops it). TRILLIUM_PANEL_LINEAR=0
sends those rows to oneDNN as before; any other value than 0 or 1 is a start-up error.

A row's result is one FMA chain per output in K order: the same bits whatever the rows beside it,
their count or the threads (the tests check it).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from trillium.kernels import dense_cpu, onednn_packed
from trillium.kernels.c_library import FLAGS, CLibrary, cpu_flags, cpu_vendor

WIDTH = 48  # panel_cpu.c's NR: output channels a panel holds


def _enabled() -> bool:
    asked = os.environ.get("TRILLIUM_PANEL_LINEAR", "1")
    if asked not in ("0", "1"):
        raise ValueError(f"TRILLIUM_PANEL_LINEAR={asked!r}: expected 1 (float32 linears of more than "
                         f"{dense_cpu.MAX_ROWS} rows on panel-packed weights, the default) or 0 (oneDNN)")
    return asked == "1"


ENABLED = _enabled()
_AVX512 = "avx512f" in cpu_flags().split() and cpu_vendor() != "GenuineIntel"  # where it was measured


def _declare(lib: ctypes.CDLL) -> None:
    lib.trillium_panel_width.argtypes = []
    lib.trillium_panel_width.restype = ctypes.c_int
    lib.trillium_panel_pack.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
    lib.trillium_panel_pack.restype = None
    lib.trillium_panel_linear.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                          ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_int]
    lib.trillium_panel_linear.restype = ctypes.c_int
    if lib.trillium_panel_width() != WIDTH:
        raise RuntimeError("panel_cpu.c was not built for AVX-512F")


_LIBRARY = CLibrary(Path(__file__).with_name("panel_cpu.c"), "the float32 panel linear kernel", _declare,
                    flags=FLAGS, fallback="oneDNN runs those rows")
# the reference switch (kernels/dispatch.py) keeps every float32 linear on its plain path
_ON = ENABLED and _AVX512 and os.environ.get("TRILLIUM_KERNELS", "") != "reference"


def available() -> bool:
    return _AVX512 and _LIBRARY.available()


def unavailable_reason() -> str | None:
    if not _AVX512:
        return "not an AVX-512F CPU other than Intel's (the kernel is built and measured for a Zen 4 only)"
    return _LIBRARY.unavailable_reason()


def active() -> bool:
    """Does models/llama.py send float32 linears past dense_cpu's rows here (switches and build)?
    native_ops binds the kernel for native decode's such rows only then, so both run the same one."""
    return _ON and _LIBRARY.get() is not None


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """float32 CPU x [M > dense_cpu.MAX_ROWS, K] with unit stride in its rows, a contiguous
    float32 parameter [N, K], bias None or contiguous float32; the library built."""
    return (
        _ON
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dim() == 2
        and x.shape[0] > dense_cpu.MAX_ROWS
        and x.stride(1) == 1
        and x.stride(0) >= x.shape[1]
        and isinstance(weight, torch.nn.Parameter)
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[1] == x.shape[1]
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()
                              and bias.shape == (weight.shape[0],)))
        and _LIBRARY.get() is not None
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 contiguous -> its panels, flat [ceil(N / 48) * K * 48] (zeros past N)."""
    n, k = weight.shape
    out = torch.empty(-(-n // WIDTH) * k * WIDTH, dtype=torch.float32)
    _LIBRARY.get().trillium_panel_pack(weight.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) -> [M, N] float32, on the weight's panels (made at the first call)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of {tuple(weight.shape)}")
    panels = onednn_packed.copy_of(weight, "panel", pack)
    out = torch.empty(m, n, dtype=torch.float32)
    rc = _LIBRARY.get().trillium_panel_linear(
        x.data_ptr(), m, k, x.stride(0), panels.data_ptr(), n, None if bias is None else bias.data_ptr(),
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"the float32 panel kernel refused x {tuple(x.shape)} @ w {tuple(weight.shape)}")
    return out


__all__ = ["ENABLED", "WIDTH", "active", "available", "linear", "pack", "takes", "unavailable_reason"]
