"""Choose the Triton kernel on CUDA, a C kernel for CPU decode attention, the torch reference elsewhere.

A call goes to Triton when its input tensor is on CUDA, Triton imports, and
TRILLIUM_KERNELS is not "reference"; shapes a Triton kernel does not handle
fall back to the reference. The Triton modules are imported lazily, on the
first CUDA call, so importing the kernels never needs a GPU or a working
Triton install, and CPU calls cost one attribute check over the reference.
CPU decode attention goes to `paged_attention_cpu` (C, built at first use)
when it takes the call, else to the reference; float32 CPU RMSNorm, SiLU-and-mul
and rope go to `rowwise_cpu` (C), eager and inside compiled graphs alike (see
the note above `_cpu_rms_norm`).
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

from trillium.kernels import paged_attention_cpu, reference, rowwise_cpu
from trillium.kernels.metadata import AttentionMetadata

# The one place the kernel choice is read from the environment. Read per CUDA
# call (not cached) so tests and operators can flip it without re-importing.
KERNELS_ENV = "TRILLIUM_KERNELS"


@functools.cache
def triton_available() -> bool:
    """True when `import triton` works (checked once, on the first CUDA call)."""
    try:
        importlib.import_module("triton")
    except Exception:  # ImportError, or a broken install failing at import
        return False
    return True


def wants_triton(tensor: torch.Tensor) -> bool:
    """Route this call to Triton? CPU tensors answer without touching env or triton."""
    return tensor.is_cuda and os.environ.get(KERNELS_ENV, "") != "reference" and triton_available()


def _triton(module: str) -> ModuleType:
    # Cached by sys.modules after the first import.
    return importlib.import_module(f"trillium.kernels.triton_{module}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if wants_triton(x):
        kernels = _triton("pointwise")
        if kernels.rms_norm_supported(x, weight):
            return kernels.rms_norm(x, weight, eps)
    if x.device.type == "cpu" and torch.compiler.is_compiling():
        return _graph_op("rms_norm", x, weight)(x, weight, eps)
    return _cpu_rms_norm(x, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if wants_triton(x) and x.stride(-1) == 1:
        return _triton("pointwise").silu_and_mul(x)
    if x.device.type == "cpu" and torch.compiler.is_compiling():
        return _graph_op("silu_and_mul", x)(x)
    return _cpu_silu_and_mul(x)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if wants_triton(q):
        head_dim = q.shape[-1]
        if q.stride(-1) != 1 or q.stride(-2) != head_dim:
            q = q.contiguous()
        if k.stride(-1) != 1 or k.stride(-2) != head_dim:
            k = k.contiguous()
        return _triton("pointwise").rotary_embedding(positions, q, k, cos_sin_cache)
    if q.device.type == "cpu" and torch.compiler.is_compiling():
        return _graph_op("rotary_embedding", q, k, cos_sin_cache)(positions, q, k, cos_sin_cache)
    return _cpu_rotary_embedding(positions, q, k, cos_sin_cache)


# The row-wise ops off CUDA: rowwise_cpu.c for float32 CPU tensors it takes, else the reference.
# WHY one C kernel for eager steps and compiled graphs alike: a row must get the same bits whichever
# ran its step. Inductor, left to it, fused the norms, rope and SiLU into loops of its own that round
# otherwise than eager (a norm's sum of squares in another order, its own exp); a row computed in a
# graph then differed in the last bits from the same row computed eagerly -- in a prefill, a mixed
# step, a verify step past the largest bucket -- and a greedy near-tie late in a request flipped with
# the batch it ran in (speculative against plain, batch 8 against 1). So in a graph these are opaque
# ops: native_ops.cpp's, calling the same C functions, where that library loaded, else the Python
# twins below, which run exactly what eager runs. Inductor still compiles what is exact (embedding,
# residual adds, views).


def _cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = rowwise_cpu.rms_norm(x, weight, eps)
    return out if out is not None else reference.rms_norm(x, weight, eps)


def _cpu_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    out = rowwise_cpu.silu_and_mul(x)
    return out if out is not None else reference.silu_and_mul(x)


def _cpu_rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    out = rowwise_cpu.rotary_embedding(positions, q, k, cos_sin_cache)
    return out if out is not None else reference.rotary_embedding(positions, q, k, cos_sin_cache)


_GRAPH_LIB = torch.library.Library("trillium", "FRAGMENT")
_GRAPH_LIB.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_GRAPH_LIB.define("silu_and_mul(Tensor x) -> Tensor")
_GRAPH_LIB.define("rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor cos_sin_cache) -> (Tensor, Tensor)")
# NOTE: contiguous and fresh, as the fakes below say (an op's outputs may not alias its inputs)
_GRAPH_LIB.impl("rms_norm", lambda x, weight, eps: _cpu_rms_norm(x, weight, eps).contiguous(), "CPU")
_GRAPH_LIB.impl("silu_and_mul", lambda x: _cpu_silu_and_mul(x).contiguous(), "CPU")
_GRAPH_LIB.impl("rotary_embedding", lambda positions, q, k, table: tuple(
    t.contiguous() for t in _cpu_rotary_embedding(positions, q, k, table)), "CPU")


# The fakes (shapes for tracing) of the three ops, in either namespace (native_ops.py registers them too)
ROW_WISE_FAKES = {
    "rms_norm": lambda x, weight, eps: x.new_empty(x.shape),
    "silu_and_mul": lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2)),
    "rotary_embedding": lambda positions, q, k, cos_sin_cache: (q.new_empty(q.shape), k.new_empty(k.shape)),
}
for _name, _fake in ROW_WISE_FAKES.items():
    torch.library.register_fake(f"trillium::{_name}")(_fake)


def _graph_op(name: str, *tensors: torch.Tensor):
    """The op a compiled graph calls for `name` (a static choice at trace time): native for float32."""
    from trillium.kernels import native_ops  # WHY here: native_ops imports the C kernels' modules

    if native_ops.loaded() and all(t.dtype == torch.float32 for t in tensors):
        return getattr(torch.ops.trillium_native, name)
    return getattr(torch.ops.trillium, name)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    if wants_triton(k) and k_cache.is_contiguous() and v_cache.is_contiguous():
        kernels = _triton("kv_cache")
        if kernels.fp8_cache_supported(k_cache) and k_cache.dtype == v_cache.dtype:
            head_dim = k.shape[-1]
            if k.stride(-1) != 1 or k.stride(-2) != head_dim:
                k = k.contiguous()
            if v.stride(-1) != 1 or v.stride(-2) != head_dim:
                v = v.contiguous()
            kernels.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
            return
    reference.write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
) -> torch.Tensor:
    # NOTE: k, v (this step's, just written) only spare the torch path gathers (fresh_prefill.py).
    # NOTE: the Triton kernel has neither a window nor soft-capping; those
    # layers run the torch reference on CUDA too (correct, not fast).
    if wants_triton(q) and sliding_window is None and softcap is None:
        kernels = _triton("attention")
        if kernels.paged_attention_supported(q, k_cache, v_cache):
            if q.stride(-1) != 1:
                q = q.contiguous()
            return kernels.paged_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale)
    elif paged_attention_cpu.decode_supported(q, k_cache, v_cache, meta):
        # Pure decode on CPU: the C kernel reads the blocks in place (no gathered copy).
        return paged_attention_cpu.decode_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale,
                                                    sliding_window=sliding_window, softcap=softcap)
    elif q.device.type == "cpu" and meta.max_query_len > 1 and (split := paged_attention_cpu.mixed_split(meta)):
        rows, rows_meta, others, others_meta = split
        q_rows = q[rows]
        if paged_attention_cpu.decode_supported(q_rows, k_cache, v_cache, rows_meta):
            # A mixed step: its decode rows through the kernel, as in a decode step (the same bits),
            # the prefill chunks through the reference.
            out = torch.empty_like(q)
            out[rows] = paged_attention_cpu.decode_attention(q_rows, k_cache, v_cache, rows_meta, scale, k_scale,
                                                             v_scale, sliding_window=sliding_window, softcap=softcap)
            out[others] = reference.paged_attention(
                q[others], k_cache, v_cache, others_meta, scale, k_scale, v_scale, sliding_window=sliding_window,
                softcap=softcap, k=None if k is None else k[others], v=None if v is None else v[others])
            return out
    return reference.paged_attention(
        q, k_cache, v_cache, meta, scale, k_scale, v_scale, sliding_window=sliding_window, softcap=softcap,
        k=k, v=v,
    )
