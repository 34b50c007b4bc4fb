"""Compute kernels: a torch reference for every op, Triton kernels on CUDA.

Public API (dispatching on the tensors' device):

    rms_norm(x, weight, eps) -> y
    silu_and_mul(x) -> y
    rotary_embedding(positions, q, k, cos_sin_cache) -> (q, k)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None (in place)
    paged_attention(q, k_cache, v_cache, meta, scale) -> out

`reference.py` defines the semantics; Triton kernels (used when the input is
on CUDA and Triton imports) must match it. Set TRILLIUM_KERNELS=reference to
force the torch path everywhere.
"""

from trillium.kernels.dispatch import (
    paged_attention,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    write_kv_cache,
)
from trillium.kernels.metadata import AttentionMetadata

__all__ = [
    "AttentionMetadata",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv_cache",
]
