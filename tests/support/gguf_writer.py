"""Write a synthetic HF checkpoint as GGUF the way llama.cpp's converter does (test helper).

Float32 tensors (exact), llama.cpp names, Q/K rows permuted for the llama
architecture, and for llama3 rope scaling a `rope_freqs.weight` tensor
(convert_hf_to_gguf.py LlamaModel.generate_extra_tensors) instead of metadata.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from safetensors.numpy import load_file

from trillium.models.config import ModelConfig

_HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_HF_TO_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    module, _, kind = hf.rpartition(".")
    if module in _HF_TO_GGUF_TOP:
        return f"{_HF_TO_GGUF_TOP[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF_BLOCK[rest]}.{kind}"


def _llama3_rope_factors(config: ModelConfig) -> np.ndarray:
    s = config.rope_scaling
    base, dim = config.rope_theta, config.head_dim
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / (base ** (i / dim)))
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(hf_dir: Path, out: Path) -> Path:
    config = ModelConfig.from_hf_dir(hf_dir)
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[config.model_type]
    writer = GGUFWriter(str(out), arch)
    writer.add_name(f"synthetic {config.model_type}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_ids[0])
    if config.rope_scaling and config.rope_scaling["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(config))
    for name, w in load_file(str(hf_dir / "model.safetensors")).items():
        w = w.astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            w = _permute(w, config.num_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = _permute(w, config.num_kv_heads)
        writer.add_tensor(_gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
