"""bench/build_draft_model.py's Q8_0 GGUF export of a draft (trillium/benchmarks/draft_distill.py
`write_gguf_q8_0`): the file is a Llama as llama.cpp's converter lays it out, checked with
transformers' own GGUF loader as the reference reader (transformers/modeling_gguf_pytorch_utils.py
un-permutes Q/K the way convert_hf_to_gguf.py LlamaModel.permute permutes them), and Trillium's
loader reads the same config from it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from trillium.benchmarks.draft_distill import write_gguf_q8_0
from trillium.models.loader import load_model_config


def _tiny_llama(path, tied=True, **extra):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                         tie_word_embeddings=tied, **extra)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger than the init's 0.02, so the logits rank tokens clearly
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_the_q8_0_gguf_is_the_draft_as_llama_cpp_lays_it_out(tmp_path, tied):
    model = _tiny_llama(tmp_path / "hf", tied)
    out = write_gguf_q8_0(tmp_path / "hf", tmp_path / "draft.gguf")
    reread = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="draft.gguf").eval()
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(ids).logits[0], reread(ids).logits[0]
    # Q8_0 rounds each weight to 1/254 of its block's largest: close, not equal
    assert (want - got).abs().mean() < 0.05 * want.abs().mean(), ((want - got).abs().mean(), want.abs().mean())
    assert (want.argmax(-1) == got.argmax(-1)).float().mean() >= 0.9
    config = load_model_config(str(out))
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads, config.vocab_size) == (
        64, 2, 2, 1, 256)
    assert config.tie_word_embeddings == tied


def test_a_draft_with_rope_scaling_is_refused(tmp_path):
    _tiny_llama(tmp_path / "hf", rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="plain Llama"):
        write_gguf_q8_0(tmp_path / "hf", tmp_path / "draft.gguf")
