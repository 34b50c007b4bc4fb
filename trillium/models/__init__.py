"""Model layer: decoder models over the paged KV cache, loaders, tokenizers.

    config.py            ModelConfig from HF config.json or GGUF metadata
    config_families.py   MoE / Gemma / per-layer attention-window parts of ModelConfig
    rope.py              cos/sin tables (default, linear, dynamic, llama3, yarn, GGUF freq factors)
    llama.py             LlamaForCausalLM (forward / compute_logits / load_weights), Phi3ForCausalLM
    moe.py               MoeForCausalLM: Qwen2-MoE, Qwen3-MoE, Mixtral
    gemma.py             GemmaForCausalLM: Gemma 2, Gemma 3 (text)
    registry.py          architecture -> model class
    int4_checkpoint.py   AWQ / GPTQ quantization_config and int32 tensors, repacked for the int4 kernel
    int4_linear.py       Int4Linear: AWQ / GPTQ projections kept at 4 bits
    loader.py            load_model(path, dtype, device), reload_weights: HF safetensors dir or .gguf
    gguf_checkpoint.py   GGUF config and dequantized (or still packed), HF-named tensors
    packed_linear.py     GgufLinear: projections kept in GGUF Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K blocks
    gguf_kquant_encode.py  float -> Q4_K / Q5_K / Q6_K bytes (gguf-py has no K-quant encoder; tests, bench/)
    checkpoint_files.py  file discovery and GGUF header reading (no torch)
    tokenizer.py         load_tokenizer(path): transformers tokenizer + chat template
    synthetic.py         build_checkpoint(path, variant): small deterministic checkpoints

Names below are imported lazily, so `trillium.models.tokenizer` (api
process) does not pull in torch through this package.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelConfig": "trillium.models.config",
    "LlamaForCausalLM": "trillium.models.llama",
    "allocate_kv_caches": "trillium.models.llama",
    "kv_cache_block_bytes": "trillium.models.llama",
    "load_model": "trillium.models.loader",
    "reload_weights": "trillium.models.loader",
    "load_tokenizer": "trillium.models.tokenizer",
    "build_checkpoint": "trillium.models.synthetic",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trillium.models' has no attribute {name!r}")
