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
NOTE: the build code repeats gguf_cpu.py's on purpose: that module is
being extended in parallel (K-quants) and the two kernels stay separable.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CHUNK = 32  # inputs per 16-byte chunk of nibbles; a group is a whole number of chunks
_SOURCE = Path(__file__).with_name("int4_cpu.c")
_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11")

_lib: ctypes.CDLL | None = None
_build_error: str | None = None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _library_path(compiler: str) -> Path:
    from trillium.local_cache import cache_dir

    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(_FLAGS).encode(), compiler.encode(), _cpu_flags().encode()):
        key.update(part)
    return cache_dir() / "kernels" / f"int4_cpu-{key.hexdigest()[:16]}.so"


def _build() -> ctypes.CDLL:
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    target = _library_path(compiler)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # WHY a temporary name: several executors may build at once; rename is atomic.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", tmp], check=True, capture_output=True, text=True)
            os.replace(tmp, target)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"{compiler} failed on {_SOURCE.name}: {exc.stderr.strip()[:500]}") from None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        log.info("built the int4 CPU kernel: %s", target)
    lib = ctypes.CDLL(str(target))
    lib.trillium_int4_matmul.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                         ctypes.c_void_p, ctypes.c_int]
    lib.trillium_int4_matmul.restype = ctypes.c_int
    lib.trillium_int4_dequantize.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                             ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
    lib.trillium_int4_dequantize.restype = ctypes.c_int
    return lib


def _library() -> ctypes.CDLL | None:
    global _lib, _build_error
    if _lib is None and _build_error is None:
        try:
            _lib = _build()
        except (RuntimeError, OSError) as exc:
            _build_error = str(exc)
            log.warning("int4 CPU kernel unavailable (%s); AWQ/GPTQ weights will be dequantized", exc)
    return _lib


def available() -> bool:
    return _library() is not None


def unavailable_reason() -> str | None:
    _library()
    return _build_error


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
    lib = _library()
    if lib is None:
        raise RuntimeError(f"int4 CPU kernel unavailable: {_build_error}")
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
