"""ShadowWeights: distributed updates land in a second copy, then swap in.

The transfer is left out (the buffers are filled by hand, as the broadcast
would); what is checked is where each tensor lands and that the live model
changes only at `swap_in`, to exactly the new values.
"""

import pytest
import torch
from safetensors.torch import load_file

from trillium.actors.executor.shadow_weights import ShadowWeights
from trillium.models.loader import load_model


@pytest.fixture
def model_and_weights(checkpoint):
    path = checkpoint("llama")
    model, _ = load_model(path, progress=False)
    return model, load_file(str(path / "model.safetensors"))


def _receive(shadow, named: dict[str, torch.Tensor]):
    names = tuple(named)
    buffers, plan = shadow.buffers(names, tuple(t.dtype for t in named.values()),
                                   tuple(tuple(t.shape) for t in named.values()), torch.device("cpu"))
    for buffer, tensor in zip(buffers, named.values()):
        buffer.copy_(tensor)  # what the broadcast does
    return buffers, plan


def _live(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_a_full_update_swaps_every_parameter_without_touching_the_model_before(model_and_weights):
    model, weights = model_and_weights
    before = _live(model)
    new = {name: torch.randn_like(t) for name, t in weights.items()}
    shadow = ShadowWeights(model)
    arena = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(arena) == 1  # the loader's arena (models/weight_arena.py)
    for round_ in range(2):  # the second round reuses the shadow
        buffers, plan = _receive(shadow, new)
        assert not plan.separate
        assert all(rows is None for rows in plan.covered.values())
        if round_ == 0:
            assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "nothing live yet"
        shadow.swap_in(plan)
        twin = type(model)(model.config, dtype=model.dtype)
        twin.load_weights(new.items())
        for name, param in model.named_parameters():
            assert torch.equal(param, dict(twin.named_parameters())[name]), name
        assert {p.untyped_storage().data_ptr() for p in model.parameters()} == arena, "copied in on the CPU"
        new = {name: torch.randn_like(t) for name, t in weights.items()}


def test_a_partial_update_of_a_fused_parameter_copies_only_its_rows(model_and_weights):
    model, weights = model_and_weights
    before = _live(model)
    q_name = "model.layers.0.self_attn.q_proj.weight"
    new_q = torch.randn_like(weights[q_name])
    shadow = ShadowWeights(model)
    _, plan = _receive(shadow, {q_name: new_q})
    fused, rows = model.resolve_weight(q_name)
    assert plan.covered == {fused: [rows]}
    shadow.swap_in(plan)
    live = dict(model.named_parameters())[fused]
    assert torch.equal(live[: rows[1]], new_q)
    assert torch.equal(live[rows[1]:], before[fused][rows[1]:]), "k and v rows kept"
    for name, param in model.named_parameters():
        if name != fused:
            assert torch.equal(param, before[name])


def test_tensors_that_do_not_fit_the_shadow_are_received_separately(model_and_weights):
    model, weights = model_and_weights
    norm = "model.norm.weight"
    named = {
        norm: weights[norm].to(torch.bfloat16),  # another dtype: converted by the copy path
        "model.layers.0.mlp.not_a_proj.weight": torch.zeros(4, 4),  # unknown: the copy path refuses it
        "model.layers.0.mlp.down_proj.weight": torch.zeros(3, 3),  # wrong shape: likewise
    }
    shadow = ShadowWeights(model)
    buffers, plan = _receive(shadow, named)
    assert plan.separate == [0, 1, 2] and not plan.covered
    assert shadow.nbytes == 0
