"""Loading: sharded checkpoints, completeness checks, no pickle, weight names, KV helpers."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from support.paged_runner import random_sequences, run_schedule
from trillium.models import LlamaForCausalLM, ModelConfig, allocate_kv_caches, kv_cache_block_bytes, load_model
from trillium.models.loader import reload_weights
from trillium.models.synthetic import build_checkpoint


def test_sharded_checkpoint_loads_same_model(checkpoint):
    single = checkpoint("qwen2")
    sharded = checkpoint("qwen2", sharded=True)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    assert not (sharded / "model.safetensors").exists()
    a, _ = load_model(single, progress=False)
    b, _ = load_model(sharded, progress=False)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    seqs = random_sequences(a.config.vocab_size, seed=4)
    for x, y in zip(run_schedule(a, seqs), run_schedule(b, seqs)):
        assert torch.equal(x, y)


def test_missing_weight_is_an_error(tmp_path, checkpoint):
    src = checkpoint("llama")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="k_proj"):
        load_model(tmp_path, progress=False)


def test_pickle_checkpoints_are_refused(tmp_path, checkpoint):
    shutil.copy(checkpoint("llama") / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="pickle"):
        load_model(tmp_path, progress=False)


def test_load_weights_fuses_and_checks(checkpoint):
    model, config = load_model(checkpoint("qwen2"), progress=False)
    weights = load_file(str(checkpoint("qwen2") / "model.safetensors"))
    qkv = model.model.layers[0].self_attn.qkv_proj
    expected = torch.cat([weights[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.weight, expected)
    assert torch.equal(qkv.bias, torch.cat([weights[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv"]))
    gate_up = model.model.layers[1].mlp.gate_up_proj.weight
    assert torch.equal(gate_up, torch.cat([weights["model.layers.1.mlp.gate_proj.weight"], weights["model.layers.1.mlp.up_proj.weight"]]))
    assert sorted(model.checkpoint_weight_names()) == sorted(weights)
    # A live update through HF names lands in the fused slice only.
    new_v = torch.full_like(weights["model.layers.0.self_attn.v_proj.weight"], 0.5)
    assert model.load_weights([("model.layers.0.self_attn.v_proj.weight", new_v)]) == {
        "model.layers.0.self_attn.v_proj.weight"
    }
    assert torch.equal(qkv.weight[config.q_size + config.kv_size :], new_v)
    assert torch.equal(qkv.weight[: config.q_size], weights["model.layers.0.self_attn.q_proj.weight"])
    with pytest.raises(KeyError):
        model.load_weights([("model.layers.0.self_attn.q_norm.weight", torch.ones(config.head_dim))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.ones(3))])
    # Buffers of old checkpoints are ignored.
    assert model.load_weights([("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8))]) == set()


def test_tied_model_has_no_head(checkpoint):
    model, config = load_model(checkpoint("llama-tied"), progress=False)
    assert config.tie_word_embeddings and model.lm_head is None
    assert model.lm_head_weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in model.checkpoint_weight_names()


def test_kv_cache_helpers():
    from trillium.models.synthetic import hf_config_dict

    config = ModelConfig.from_hf_config(hf_config_dict("qwen3"))
    caches = allocate_kv_caches(config, num_blocks=3, block_size=8, dtype="bfloat16", device="cpu")
    assert len(caches) == config.num_layers
    k, v = caches[0]
    assert k.shape == v.shape == (3, 8, config.num_kv_heads, config.head_dim)
    assert k.dtype == torch.bfloat16
    per_block = kv_cache_block_bytes(config, 8, torch.bfloat16)
    assert per_block == 2 * config.num_layers * 8 * config.num_kv_heads * config.head_dim * 2
    total = sum(t.numel() * t.element_size() for pair in caches for t in pair)
    assert total == 3 * per_block


def test_empty_model_has_valid_rope_table(checkpoint):
    config = ModelConfig.from_hf_dir(checkpoint("llama"))
    model = LlamaForCausalLM.empty(config, max_positions=32)
    assert model.cos_sin_cache.shape == (32, config.head_dim)
    assert model.cos_sin_cache[0, : config.head_dim // 2].eq(1).all()  # cos(0)


def _digest(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_synthetic_build_is_deterministic(tmp_path):
    a = build_checkpoint(tmp_path / "a", "qwen3")
    b = build_checkpoint(tmp_path / "b", "qwen3")
    assert _digest(a) == _digest(b)
    c = build_checkpoint(tmp_path / "c", "qwen3", seed=1)
    assert _digest(c)["model.safetensors"] != _digest(a)["model.safetensors"]
    assert _digest(c)["tokenizer.json"] == _digest(a)["tokenizer.json"]


def test_synthetic_overrides_and_dtype(tmp_path):
    path = build_checkpoint(tmp_path / "x", "llama", dtype="bfloat16", num_hidden_layers=3, vocab_size=600)
    config = ModelConfig.from_hf_dir(path)
    assert (config.num_layers, config.vocab_size, config.dtype) == (3, 600, "bfloat16")
    model, _ = load_model(path, progress=False)
    assert model.dtype == torch.bfloat16
    assert len(json.loads((path / "tokenizer.json").read_text())["added_tokens"]) >= 7


def test_reload_weights_from_another_checkpoint(checkpoint):
    model, _ = load_model(checkpoint("mistral"), progress=False)
    other, _ = load_model(checkpoint("mistral", seed=7), progress=False)
    assert not torch.equal(model.lm_head_weight, other.lm_head_weight)
    reload_weights(model, checkpoint("mistral", seed=7), progress=False)
    for (name, x), (_, y) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(x, y), name
    with pytest.raises(ValueError, match="different model"):
        reload_weights(model, checkpoint("qwen3"), progress=False)
