"""Choose the Triton kernel on CUDA, a C kernel for CPU decode attention, the torch reference elsewhere.

A call goes to Triton when its input tensor is on CUDA, Triton imports, and
TRILLIUM_KERNELS is not "reference"; shapes a Triton kernel does not handle
fall back to the reference. The Triton modules are imported lazily, on the
first CUDA call, so importing the kernels never needs a GPU or a working
Triton install, and CPU calls cost one attribute check over the reference.
CPU decode attention goes to `paged_attention_cpu` (C, built at first use)
when it takes the call, else to the reference.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

from trillium.kernels import paged_attention_cpu, reference
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
    return reference.rms_norm(x, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if wants_triton(x) and x.stride(-1) == 1:
        return _triton("pointwise").silu_and_mul(x)
    return reference.silu_and_mul(x)


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
    return reference.rotary_embedding(positions, q, k, cos_sin_cache)


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
