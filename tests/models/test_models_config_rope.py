"""ModelConfig parsing and rope tables against transformers' own computations."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from trillium.models.config import ModelConfig
from trillium.models.rope import build_cos_sin_cache, parse_rope_config
from trillium.models.synthetic import VARIANTS, hf_config_dict

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
}
ROPE_CASES = {
    "default": {},
    "linear": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 3.0}},
    "llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    },
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
    "v5-llama3": {
        "rope_theta": None,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
}


def _hf_dict(case: str) -> dict:
    d = {**BASE, **ROPE_CASES[case]}
    return {k: v for k, v in d.items() if v is not None}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_table_matches_transformers(case):
    hf_dict = _hf_dict(case)
    config = ModelConfig.from_hf_config(hf_dict)
    table = build_cos_sin_cache(config)
    rotary = LlamaRotaryEmbedding(LlamaConfig(**hf_dict))
    # HF computes per forward; within max_position_embeddings every type is position-indexed.
    positions = torch.arange(config.max_position_embeddings)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    half = config.head_dim // 2
    torch.testing.assert_close(table[: positions.shape[1], :half], cos[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(table[: positions.shape[1], half:], sin[0, :, :half], atol=1e-6, rtol=0)


def test_rope_table_lengths():
    assert build_cos_sin_cache(ModelConfig.from_hf_config(_hf_dict("default"))).shape == (128, 16)
    assert build_cos_sin_cache(ModelConfig.from_hf_config(_hf_dict("linear"))).shape == (256, 16)
    dynamic = build_cos_sin_cache(ModelConfig.from_hf_config(_hf_dict("dynamic")))
    default = build_cos_sin_cache(ModelConfig.from_hf_config(_hf_dict("default")), 384)
    assert dynamic.shape == (384, 16)
    # Inside the trained window: plain rope; beyond: a larger (NTK) base, i.e. slower rotation.
    assert torch.equal(dynamic[:128], default[:128])
    assert not torch.allclose(dynamic[200:], default[200:])


def test_parse_rope_config_old_and_new_keys():
    assert parse_rope_config({"rope_theta": 5.0}) == (5.0, None)
    assert parse_rope_config({}) == (10000.0, None)
    assert parse_rope_config({"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}) == (7.0, None)
    old = parse_rope_config({"rope_theta": 3.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = parse_rope_config({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 3.0}})
    assert old == new == (3.0, {"rope_type": "linear", "factor": 2.0})
    with pytest.raises(NotImplementedError):
        parse_rope_config({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}})


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_agrees_with_transformers(tmp_path, variant):
    import json

    hf_dict = hf_config_dict(variant)
    (tmp_path / "config.json").write_text(json.dumps(hf_dict))
    ours = ModelConfig.from_hf_dir(tmp_path)
    hf = AutoConfig.from_pretrained(str(tmp_path))
    assert ours.architecture == hf.architectures[0]
    assert ours.hidden_size == hf.hidden_size
    assert ours.num_layers == hf.num_hidden_layers
    assert ours.num_heads == hf.num_attention_heads
    assert ours.num_kv_heads == hf.num_key_value_heads
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    rope = hf.rope_parameters
    if "full_attention" in rope:  # Gemma 3: one entry per layer type
        assert ours.gemma.local_rope_theta == rope["sliding_attention"]["rope_theta"]
        rope = rope["full_attention"]
    assert ours.rope_theta == rope["rope_theta"]
    assert (ours.rope_scaling or {}).get("rope_type", "default") == rope["rope_type"]
    assert ours.sliding_window == (getattr(hf, "sliding_window", None) or None)
    if getattr(hf, "layer_types", None) is not None and ours.sliding_window is not None:
        windows = [ours.layer_window(i) for i in range(ours.num_layers)]
        assert windows == [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.dtype == "float32"


def test_config_flags_per_architecture():
    qwen2 = ModelConfig.from_hf_config(hf_config_dict("qwen2"))
    assert qwen2.attention_bias and not qwen2.attention_out_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_hf_config(hf_config_dict("qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.q_size != qwen3.hidden_size
    llama_bias = ModelConfig.from_hf_config({**BASE, "attention_bias": True, "mlp_bias": True})
    assert llama_bias.attention_bias and llama_bias.attention_out_bias and llama_bias.mlp_bias
    eos = ModelConfig.from_hf_config({**BASE, "eos_token_id": [5, 7]}, {"eos_token_id": [7, 9]})
    assert eos.eos_token_ids == (5, 7, 9) and eos.eos_token_id == 5
    bf16 = ModelConfig.from_hf_config({**BASE, "torch_dtype": "bfloat16"})
    assert bf16.dtype == "bfloat16" and bf16.torch_dtype == torch.bfloat16
    mistral = ModelConfig.from_hf_config({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 64})
    assert mistral.sliding_window == 64
    with pytest.raises(ValueError):
        ModelConfig.from_hf_config({**BASE, "architectures": ["GPT2LMHeadModel"]})
