"""Write an HF checkpoint as GGUF the way llama.cpp's converter does: the tests' synthetic
checkpoints, and bench/build_draft_model.py's Q8_0 draft (benchmarks/draft_distill.py).

Float32 tensors (exact), llama.cpp names, Q/K rows permuted for the llama
architecture, and for llama3 rope scaling a `rope_freqs.weight` tensor
(convert_hf_to_gguf.py LlamaModel.generate_extra_tensors) instead of metadata.
With `quantize`, chosen 2-D weights are stored as llama.cpp blocks (Q8_0, Q4_1, ...)
through gguf-py's own quantizers; Q4_K / Q5_K / Q6_K, which gguf-py cannot encode,
through trillium.models.gguf_kquant_encode (ggml's layout, a round-to-nearest fit).

Families: the dense Llama ones, Phi-3 (`attn_qkv`, fused gate/up as `ffn_up`)
and the MoE ones: qwen2moe / qwen3moe, and Mixtral as `llama` with
`expert_count`; experts stacked into `ffn_{gate,up,down}_exps` [E, rows, cols],
the router as `ffn_gate_inp`, Qwen2-MoE's shared expert as `*_shexp` with its
gate squeezed to [H] (the names gguf-py's MODEL_TENSORS lists for those
architectures; the stacking and squeeze as transformers' GGUF loader undoes them,
modeling_gguf_pytorch_utils.py `Qwen2MoeTensorProcessor`).

Gemma 2 / Gemma 3 as llama.cpp's Gemma2Model / Gemma3Model (convert_hf_to_gguf.py,
conversion/gemma.py): every `*norm.weight` stored + 1; the post-attention,
pre- and post-feedforward norms as `post_attention_norm`, `ffn_norm`,
`post_ffw_norm`; Gemma 2 drops `lm_head` (llama.cpp always ties it) and
writes no rope base; soft-capping and the sliding window as metadata; Gemma 3
writes the full-attention layers' rope base and scaling only (llama.cpp fixes
the sliding layers' base, 10000, and the 5:1 layer pattern). NOTE: the
converter also trims `token_embd` to the tokenizer's size; the synthetic
tokenizers fill the vocabulary, so there is nothing to trim.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable

import numpy as np

from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf import quants as gguf_quants
from safetensors.numpy import load_file

from trillium.models import gguf_kquant_encode
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
_HF_TO_GGUF_BLOCK.update({
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
})
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_STACK = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps", "w3": "ffn_up_exps",
                 "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}  # fmt: skip
_GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}  # fmt: skip
_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
         "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama",
         "gemma2": "gemma2", "gemma3_text": "gemma3"}  # fmt: skip
_HF_TO_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str, arch: str) -> str:
    module, _, kind = hf.rpartition(".")
    if module in _HF_TO_GGUF_TOP:
        return f"{_HF_TO_GGUF_TOP[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)
    if arch.startswith("gemma") and rest in _GEMMA_NORMS:
        return f"blk.{layer}.{_GEMMA_NORMS[rest]}.{kind}"
    return f"blk.{layer}.{_HF_TO_GGUF_BLOCK[rest]}.{kind}"


def _gemma_metadata(writer: GGUFWriter, config: ModelConfig) -> None:
    gemma = config.gemma
    if gemma.attn_logit_softcapping is not None:
        writer.add_attn_logit_softcapping(gemma.attn_logit_softcapping)
    if gemma.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(gemma.final_logit_softcapping)
    if config.rope_scaling and config.rope_scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_scaling["factor"])


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


def _stack_experts(writer: GGUFWriter, config: ModelConfig, weights: dict[str, np.ndarray]) -> dict:
    """Write the MoE metadata and the stacked expert tensors; the other weights, to write as usual."""
    moe = config.moe
    writer.add_expert_count(moe.num_experts)
    writer.add_expert_used_count(moe.top_k)
    if config.architecture != "MixtralForCausalLM":
        writer.add_expert_feed_forward_length(moe.expert_intermediate_size)
    if moe.shared_expert_intermediate_size:
        writer.add_expert_shared_feed_forward_length(moe.shared_expert_intermediate_size)
    stacks: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    rest = {}
    for name, w in weights.items():
        if match := _EXPERT.match(name):
            layer, expert, proj = int(match[1]), int(match[2]), match[3]
            stacks.setdefault((layer, _EXPERT_STACK[proj]), {})[expert] = w.astype(np.float32)
        else:
            rest[name] = w
    for (layer, stacked), per_expert in sorted(stacks.items()):
        writer.add_tensor(f"blk.{layer}.{stacked}.weight", np.stack([per_expert[e] for e in sorted(per_expert)]))
    return rest


def write_gguf(hf_dir: Path, out: Path, quantize: Callable[[str], GGMLQuantizationType | None] | None = None,
               name: str | None = None) -> Path:
    """`quantize(gguf name)`: the type to store a 2-D weight in (gguf.quants.quantize: Q8_0, Q4_0, Q4_1, ...);
    `name`: general.name (default "synthetic <model_type>")."""
    config = ModelConfig.from_hf_dir(hf_dir)
    arch = _ARCH[config.model_type]
    writer = GGUFWriter(str(out), arch)
    writer.add_name(name or f"synthetic {config.model_type}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch != "gemma2":
        writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_ids[0])
    if config.rope_scaling and config.rope_scaling["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(config))
    if config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
    weights = load_file(str(hf_dir / "model.safetensors"))
    if config.gemma is not None:
        _gemma_metadata(writer, config)
    if arch == "gemma2":
        weights.pop("lm_head.weight", None)
    if config.moe is not None:
        weights = _stack_experts(writer, config, weights)
    for name, w in weights.items():
        w = w.astype(np.float32)
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(-1)
        if arch == "llama" and ".q_proj." in name:
            w = _permute(w, config.num_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = _permute(w, config.num_kv_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + np.float32(1.0)
        qtype = quantize(_gguf_name(name, arch)) if quantize is not None and w.ndim == 2 else None
        if qtype is None:
            writer.add_tensor(_gguf_name(name, arch), w)
        else:
            encode = gguf_kquant_encode.quantize if int(qtype) in gguf_kquant_encode.TYPES else gguf_quants.quantize
            writer.add_tensor(_gguf_name(name, arch), encode(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
