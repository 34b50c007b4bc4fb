"""Weight updates by name on MoE models: Hub per-expert names and transformers 5's fused names.

An RL trainer sends either the checkpoint's names (`mlp.experts.3.up_proj.weight`,
Mixtral `block_sparse_moe.experts.3.w3.weight`) or what its transformers 5
model's `named_parameters()` yields (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I], `mlp.gate.weight`); transformers'
conversion_mapping.py merges the former into the latter on load. Both must
land in the same rows (update_weights_from_disk / _tensor / _distributed all
go through `load_weights`, `WeightValidator` and `ShadowWeights`).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from support.paged_runner import hf_logits, load_hf, random_sequences, run_schedule
from trillium.actors.executor.shadow_weights import ShadowWeights
from trillium.actors.executor.weights import WeightValidator
from trillium.actors.protocol.admin import ControlError
from trillium.models import load_model


@pytest.mark.parametrize("variant", ["qwen2-moe", "mixtral"])
def test_transformers_named_parameters_update_the_model(checkpoint, variant):
    path = checkpoint(variant)
    model, config = load_model(path, progress=False)
    hf_model = load_hf(path)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "experts" in name or name.endswith("mlp.gate.weight"):
                param.add_(0.05 * torch.randn(param.shape, generator=gen))
    named = [(n, p.detach().clone()) for n, p in hf_model.named_parameters()]
    assert any(t.dim() == 3 for _, t in named), "transformers 5 keeps experts as 3-D tensors"
    WeightValidator(model).check(named)
    model.load_weights(named)
    sequences = random_sequences(config.vocab_size, seed=4)
    ours, ref = run_schedule(model, sequences), hf_logits(hf_model, sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) < 1e-4


def test_validator_checks_hub_expert_names(checkpoint):
    path = checkpoint("qwen3-moe")
    model, _ = load_model(path, progress=False)
    weights = load_file(str(path / "model.safetensors"))
    assert set(model.checkpoint_weight_names()) == set(weights)
    validator = WeightValidator(model)
    assert validator.check(weights.items(), complete=True) == set(weights)
    up = "model.layers.0.mlp.experts.3.up_proj.weight"
    with pytest.raises(ControlError, match="experts.8.up_proj"):  # the model has 8 experts: 0..7
        validator.check([(up.replace("experts.3", "experts.8"), weights[up])])
    with pytest.raises(ControlError, match="checkpoint shape"):
        validator.check([(up, weights[up][:-1])])
    missing = {n: t for n, t in weights.items() if n != up}
    with pytest.raises(ControlError, match="lacks 1 weights"):
        validator.check(missing.items(), complete=True)


def test_shadow_update_of_one_expert_copies_only_its_rows(checkpoint):
    path = checkpoint("mixtral")
    model, config = load_model(path, progress=False)
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    param_name, rows = model.resolve_weight(name)
    assert param_name == "model.layers.1.mlp.experts.w13_weight"
    inter = config.moe.expert_intermediate_size
    assert rows == ((2 * 2 + 1) * inter, inter)
    before = dict(model.named_parameters())[param_name].detach().clone()
    new = torch.randn(inter, config.hidden_size)
    shadow = ShadowWeights(model)
    buffers, plan = shadow.buffers((name,), (torch.float32,), ((inter, config.hidden_size),), torch.device("cpu"))
    buffers[0].copy_(new)
    assert plan.covered == {param_name: [rows]} and not plan.separate
    shadow.swap_in(plan)
    live = dict(model.named_parameters())[param_name]
    assert torch.equal(live[rows[0] : rows[0] + inter], new)
    untouched = torch.ones(live.shape[0], dtype=torch.bool)
    untouched[rows[0] : rows[0] + inter] = False
    assert torch.equal(live[untouched], before[untouched])


def test_update_from_disk_refuses_other_routing(checkpoint):
    """Same shapes, another top-k: every tensor would fit, so the config must be compared too."""
    from trillium.actors.executor.weights import read_checkpoint

    model, _ = load_model(checkpoint("qwen2-moe"), progress=False)
    same = read_checkpoint(str(checkpoint("qwen2-moe", seed=1)), model)
    assert {name for name, _ in same} == set(model.checkpoint_weight_names())
    with pytest.raises(ControlError, match="different model: moe="):
        read_checkpoint(str(checkpoint("qwen2-moe", num_experts_per_tok=1)), model)
