"""GGUF files written like llama.cpp's converter load to the same model as the HF checkpoint.

Covers what SmolLM2 does not: qkv bias (qwen2), q/k norm and explicit head_dim
(qwen3, no Q/K permutation), untied heads, and llama3 rope via `rope_freqs`.
"""

from __future__ import annotations

import pytest
import torch

from trillium.models.gguf_writer import write_gguf
from support.paged_runner import hf_logits, load_hf, max_abs_diff, random_sequences, run_schedule
from trillium.models import ModelConfig, load_model


@pytest.mark.parametrize("variant", ["llama", "llama-tied", "qwen2", "qwen3"])
def test_gguf_matches_hf_checkpoint(checkpoint, tmp_path, variant):
    hf_dir = checkpoint(variant)
    gguf_path = write_gguf(hf_dir, tmp_path / "model.gguf")
    model, config = load_model(gguf_path, progress=False)
    hf_config = ModelConfig.from_hf_dir(hf_dir)
    for field in ("architecture", "num_heads", "num_kv_heads", "head_dim", "attention_bias", "qk_norm"):
        assert getattr(config, field) == getattr(hf_config, field), field
    assert config.tie_word_embeddings == hf_config.tie_word_embeddings
    if variant == "llama":
        assert config.rope_scaling["rope_type"] == "freq_factors"
    sequences = random_sequences(config.vocab_size, seed=5)
    ours = run_schedule(model, sequences)
    assert max_abs_diff(ours, hf_logits(load_hf(hf_dir), sequences)) < 1e-4
    # The directory form finds the single .gguf.
    again, _ = load_model(tmp_path, progress=False)
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_header_reader_agrees_with_gguf_reader(checkpoint, tmp_path):
    from trillium.models.checkpoint_files import read_gguf_header
    from trillium.models.gguf_checkpoint import open_gguf, read_metadata

    path = write_gguf(checkpoint("qwen3"), tmp_path / "model.gguf")
    header = read_gguf_header(path)
    full = read_metadata(open_gguf(path))
    assert set(full) <= set(header)
    for key, value in full.items():
        assert header[key] == value, key
    assert header["qwen3.attention.key_length"] == 32


@pytest.mark.parametrize(
    "variant, overrides",
    [("qwen2-moe", {}), ("qwen3-moe", {"mlp_only_layers": ()}), ("mixtral", {}), ("phi3", {})],
)
def test_gguf_families_match_hf_checkpoint(checkpoint, tmp_path, variant, overrides):
    """MoE (stacked `*_exps`, router, shared expert) and Phi-3 (fused attn_qkv / ffn_up) GGUF files.

    NOTE: llama.cpp has no dense layers in qwen3moe (mlp_only_layers), so that
    checkpoint is built with every layer sparse.
    """
    hf_dir = checkpoint(variant, **overrides)
    gguf_path = write_gguf(hf_dir, tmp_path / "model.gguf")
    model, config = load_model(gguf_path, progress=False)
    hf_config = ModelConfig.from_hf_dir(hf_dir)
    for field in ("architecture", "num_heads", "num_kv_heads", "head_dim", "attention_bias", "qk_norm",
                  "moe", "sliding_window", "tie_word_embeddings"):  # fmt: skip
        assert getattr(config, field) == getattr(hf_config, field), field
    sequences = random_sequences(config.vocab_size, seed=5)
    ours = run_schedule(model, sequences)
    assert max_abs_diff(ours, hf_logits(load_hf(hf_dir), sequences)) < 1e-4


def test_gguf_longrope_is_refused(checkpoint, tmp_path):
    from gguf import GGUFReader

    from trillium.models.gguf_checkpoint import read_metadata

    path = write_gguf(checkpoint("phi3"), tmp_path / "model.gguf")
    metadata = read_metadata(GGUFReader(str(path)))
    names = {t.name for t in GGUFReader(str(path)).tensors} | {"rope_factors_long.weight"}
    with pytest.raises(NotImplementedError, match="longrope"):
        ModelConfig.from_gguf_metadata(metadata, names)
