"""The families beyond dense Llama match transformers, through the paged path, past their windows.

Each family's tiny checkpoint (`trillium.models.synthetic`) runs through
`model.forward` with the paged KV cache (ragged prefill, a chunk with
context, decodes) and is compared with transformers' full-sequence logits.
The second sequence (41 tokens) is longer than every sliding window
(Mistral 24, Phi-3 32, Gemma 16), so the masks and Gemma 3's local rope
table are exercised both in chunked prefill and in decode.

Oracles (transformers 5, installed): modeling_qwen2_moe.py, modeling_qwen3_moe.py,
modeling_mixtral.py (TopKRouter, Experts), modeling_gemma2.py / modeling_gemma3.py
(soft-capping, (1 + w) norms, per-layer-type rope), modeling_phi3.py, and
masking_utils.py `sliding_window_overlay` (key j visible from query q iff q - window < j <= q).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from support.serve_process import free_port
from support.paged_runner import hf_logits, load_hf, max_abs_diff, random_sequences, run_schedule
from trillium.kernels import moe as moe_kernels
from trillium.models import load_model
from trillium.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from trillium.models.registry import ARCHITECTURES
from trillium.models.synthetic import hf_config_dict

FAMILIES = ["mistral-sliding", "phi3", "qwen2-moe", "qwen3-moe", "mixtral", "gemma2", "gemma3"]
LENGTHS = (9, 41, 6)
# Sequence 1: a 30-token prefill (past the 16/24-token windows), a 7-token chunk with context, decodes.
SCHEDULE = (
    ((0, 6), (1, 30), (2, 3)),
    ((0, 1), (1, 7), (2, 1)),
    ((0, 1), (1, 1), (2, 1)),
    ((0, 1), (1, 1), (2, 1)),
    ((1, 1),),
    ((1, 1),),
)


@pytest.mark.parametrize("variant, overrides", [(v, {}) for v in FAMILIES] + [("gemma3", {"tie_word_embeddings": True})])
def test_family_logits_match_transformers_past_the_window(checkpoint, variant, overrides):
    """Gemma ships tied; the tied variant is checked here by logits (its greedy tokens just echo)."""
    path = checkpoint(variant, **overrides)
    model, config = load_model(path, progress=False)
    sequences = random_sequences(config.vocab_size, lengths=LENGTHS, seed=1)
    ours = run_schedule(model, sequences, schedule=SCHEDULE, num_blocks=64)
    ref = hf_logits(load_hf(path), sequences)
    assert max_abs_diff(ours, ref) < 1e-4
    for a, b in zip(ours, ref):
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("variant", ["mistral-sliding", "gemma2"])
def test_the_window_changes_the_result(checkpoint, variant):
    """Guard on the test above: without the window the long sequence's logits are far from HF's."""
    path = checkpoint(variant)
    model, config = load_model(path, progress=False)
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    sequences = random_sequences(config.vocab_size, lengths=LENGTHS, seed=1)
    ours = run_schedule(model, sequences, schedule=SCHEDULE, num_blocks=64)
    ref = hf_logits(load_hf(path), sequences)
    assert (ours[0] - ref[0]).abs().max() < 1e-4  # 9 tokens: inside every window
    assert (ours[1] - ref[1]).abs().max() > 0.1


def test_family_configs():
    qwen2 = ModelConfig.from_hf_config(hf_config_dict("qwen2-moe")).moe
    assert (qwen2.num_experts, qwen2.top_k, qwen2.norm_topk_prob, qwen2.shared_expert_intermediate_size) == (
        4, 2, False, 96)  # fmt: skip
    qwen3 = ModelConfig.from_hf_config(hf_config_dict("qwen3-moe"))
    assert qwen3.moe.sparse_layers == (0,) and qwen3.moe.norm_topk_prob and qwen3.qk_norm
    mixtral = ModelConfig.from_hf_config(hf_config_dict("mixtral")).moe
    assert mixtral.norm_topk_prob and mixtral.expert_intermediate_size == 48
    gemma2 = ModelConfig.from_hf_config(hf_config_dict("gemma2"))
    assert [gemma2.layer_window(i) for i in range(2)] == [16, None]  # HF's default pattern
    assert gemma2.gemma.attn_logit_softcapping == 50.0 and gemma2.gemma.local_rope_theta is None
    gemma3 = ModelConfig.from_hf_config(hf_config_dict("gemma3"))
    assert [gemma3.layer_window(i) for i in range(3)] == [16, 16, None]
    assert gemma3.gemma.local_rope_theta == 10000.0 and gemma3.rope_theta == 1e6
    legacy = {**hf_config_dict("gemma3"), "rope_parameters": None, "layer_types": None,
              "rope_theta": 1e6, "rope_local_base_freq": 5000.0, "sliding_window_pattern": 3}  # fmt: skip
    legacy = ModelConfig.from_hf_config(legacy)
    assert legacy.gemma.local_rope_theta == 5000.0 and legacy.layer_types[2] == "full_attention"
    mistral = ModelConfig.from_hf_config(hf_config_dict("mistral-sliding"))
    assert mistral.layer_types is None and mistral.layer_window(1) == 24


def test_every_supported_architecture_has_a_model_class():
    assert set(SUPPORTED_ARCHITECTURES) == set(ARCHITECTURES)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, r"unsupported architecture 'GPT2LMHeadModel'; supported: .*"
                                                  r"Qwen3MoeForCausalLM.*Gemma2ForCausalLM"),
        ({"architectures": ["DeepseekV3ForCausalLM"]}, r"unsupported architecture 'DeepseekV3ForCausalLM'"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "longrope"),
        ({"rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [1.0]}}, "'su'"),
        ({"partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75"),
    ],
)
def test_unsupported_configs_fail_naming_what(overrides, message):
    with pytest.raises((ValueError, NotImplementedError), match=message):
        ModelConfig.from_hf_config({**hf_config_dict("phi3"), **overrides})


def test_gemma_bidirectional_and_other_activations_are_refused():
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_config({**hf_config_dict("gemma3"), "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="hidden_activation 'relu'"):
        ModelConfig.from_hf_config({**hf_config_dict("gemma2"), "hidden_activation": "relu"})


def _hf_style_moe(x, w13, w2, weights, ids):
    """transformers' Experts loop (one-hot mask, `torch.where` per expert), the oracle."""
    out = torch.zeros_like(x)
    mask = torch.nn.functional.one_hot(ids, num_classes=w13.shape[0]).permute(2, 1, 0)
    for expert in range(w13.shape[0]):
        slot, token = torch.where(mask[expert])
        if token.numel() == 0:
            continue
        gate, up = torch.nn.functional.linear(x[token], w13[expert]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[expert])
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


@pytest.mark.parametrize("num_tokens", [0, 1, 5, 37])
def test_fused_moe_matches_the_per_expert_loop(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    experts, hidden, inter = 6, 16, 8
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen)
    logits = torch.randn(num_tokens, experts, generator=gen)
    logits[:, 5] = -1e9  # expert 5 gets no tokens
    weights, ids = moe_kernels.route(logits, 2, renormalize=True)
    if num_tokens:
        assert torch.allclose(weights.sum(-1), torch.ones(num_tokens)) and (ids != 5).all()
    ours = moe_kernels.fused_moe(x, w13, w2, weights, ids)
    assert ours.shape == x.shape
    assert torch.allclose(ours, _hf_style_moe(x, w13, w2, weights, ids), atol=1e-5)


def test_serve_refuses_an_unsupported_architecture_at_start(checkpoint, tmp_path):
    """Gemma 3's multimodal checkpoints are what people try first; the text-only class loads."""
    architecture = "Gemma3ForConditionalGeneration"
    model = tmp_path / "model"
    shutil.copytree(checkpoint("llama"), model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = [architecture]
    (model / "config.json").write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "trillium.cli", "serve", "--model", str(model), "--port", str(free_port()),
           "--admin-port", str(free_port())]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"unsupported architecture '{architecture}'" in done.stderr
    assert "supported: LlamaForCausalLM" in done.stderr and "MixtralForCausalLM, Gemma2ForCausalLM" in done.stderr
