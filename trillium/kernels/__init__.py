"""Compute kernels: a torch reference for every op, Triton kernels on CUDA.

Public API (dispatching on the tensors' device):

    rms_norm(x, weight, eps) -> y
    silu_and_mul(x) -> y
    rotary_embedding(positions, q, k, cos_sin_cache) -> (q, k)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None (in place)
    paged_attention(q, k_cache, v_cache, meta, scale, k_scale=None, v_scale=None,
                    *, sliding_window=None, softcap=None, k=None, v=None) -> out
                    (k, v: this step's, spare context-free prefills the gather; fresh_prefill.py)
    fused_moe(x, w13, w2, topk_weights, topk_ids, activation) -> y   (moe.py; torch on every device)
    gguf_cpu.matmul(x, blocks, ggml_type, k) -> y   (GGUF Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K weights,
                                                     CPU float32; C, built at first use)

On CPU, paged_attention of a pure decode step (float32 queries, float32 or
fp8 caches) runs `paged_attention_cpu.c`, which reads the blocks in place;
float32 rms_norm, silu_and_mul and rotary_embedding run `rowwise_cpu.c` (the
same machine code eager and in compiled decode graphs); everything else runs
the reference.

KV caches are float32 / bfloat16 / float16, or fp8 (float8_e4m3fn,
float8_e5m2) with per-tensor float32 scales: values are stored divided by
the scale and read back multiplied by it (see `fp8.py`).

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
