"""LoRASlots buffer layout and LoRABatch segments, without peft or a forward pass."""

from __future__ import annotations

import pytest
import torch

from support.lora_adapters import random_adapter
from trillium.lora import AdapterError, LoRABatch, LoRASlots
from trillium.lora.adapter import module_dims
from trillium.models.loader import load_model_config


@pytest.fixture(scope="module")
def config(checkpoint):
    return load_model_config(checkpoint("llama"))


def test_load_folds_scaling_and_zero_pads(config):
    slots = LoRASlots(config, max_loras=3, max_rank=8)
    adapter = random_adapter(config, ["k_proj", "up_proj"], rank=4, scaling=0.25)
    slots.load(2, adapter)
    assert slots.targets(2) == {"k_proj", "up_proj"} and slots.targets(0) == frozenset()
    qkv = slots.layers[1]["qkv_proj"]
    assert qkv.a.shape == (3, 3 * 8, config.hidden_size)
    assert qkv.out_offsets == (0, config.q_size, config.q_size + config.kv_size)
    w = adapter.weights[(1, "k_proj")]
    assert torch.equal(qkv.a[2, 8:12], w.a)  # k is slice 1: rows [8, 12)
    assert not qkv.a[2, :8].any() and not qkv.a[2, 12:].any()
    torch.testing.assert_close(qkv.b[1][2, :, :4], w.b * 0.25)
    assert not qkv.b[1][2, :, 4:].any() and not qkv.b[0][2].any() and not qkv.b[2][2].any()
    gate_up = slots.layers[0]["gate_up_proj"]
    assert gate_up.out_offsets == (0, config.intermediate_size)
    assert torch.equal(gate_up.a[2, 8:12], adapter.weights[(0, "up_proj")].a)
    for other_slot in (0, 1):
        assert not qkv.a[other_slot].any() and not gate_up.b[1][other_slot].any()


def test_reload_replaces_everything_and_bad_adapter_leaves_slot(config):
    slots = LoRASlots(config, max_loras=1, max_rank=8)
    slots.load(0, random_adapter(config, ["q_proj", "down_proj"], rank=8, seed=1))
    small = random_adapter(config, ["q_proj"], rank=2, seed=2)
    slots.load(0, small)
    qkv, down = slots.layers[0]["qkv_proj"], slots.layers[0]["down_proj"]
    assert torch.equal(qkv.a[0, :2], small.weights[(0, "q_proj")].a) and not qkv.a[0, 2:].any()
    assert not down.a.any() and not down.b[0].any()
    assert slots.targets(0) == {"q_proj"}
    before = qkv.a.clone()
    with pytest.raises(AdapterError, match="exceeds max_lora_rank 8"):
        slots.load(0, random_adapter(config, ["q_proj"], rank=16))
    assert torch.equal(qkv.a, before) and slots.targets(0) == {"q_proj"}
    with pytest.raises(IndexError):
        slots.load(1, small)


def test_bfloat16_slots_round_the_scaled_b_once(config):
    slots = LoRASlots(config, max_loras=1, max_rank=4, dtype=torch.bfloat16)
    adapter = random_adapter(config, ["o_proj"], rank=4, scaling=3.0)
    slots.load(0, adapter)
    b = slots.layers[0]["o_proj"].b[0]
    assert b.dtype == torch.bfloat16
    assert torch.equal(b[0], (adapter.weights[(0, "o_proj")].b * 3.0).to(torch.bfloat16))
    dims = module_dims(config)
    expected = sum(
        2 * (len(ms) * 4 * dims[ms[0]][0] + sum(dims[m][1] * 4 for m in ms))
        for ms in (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
    ) * config.num_layers
    assert slots.num_bytes == expected


def test_build_merges_adjacent_requests_of_one_slot(config):
    slots = LoRASlots(config, max_loras=2, max_rank=4)
    slots.load(1, random_adapter(config, ["q_proj", "o_proj"], rank=4))
    batch = LoRABatch.build(slots, [5, 1, 0, 3, 2, 4], [1, 1, 0, -1, -1, 1])
    assert batch.seg_starts.tolist() == [0, 6, 11]
    assert batch.seg_lens.tolist() == [6, 5, 4]
    assert batch.seg_slots.tolist() == [1, -1, 1]
    assert batch.seg_starts.dtype == torch.int32 and batch.num_tokens == 15
    # Slot 0 (empty, 0 tokens) adds nothing; only the slices slot 1 adapts run.
    assert batch.active_slices == {"qkv_proj": (0,), "o_proj": (0,)}
    assert batch.has_work


def test_build_without_adapters_has_no_work(config):
    slots = LoRASlots(config, max_loras=2, max_rank=4)
    assert not LoRABatch.build(slots, [3, 1], [-1, -1]).has_work
    assert not LoRABatch.build(slots, [3, 1], [0, -1]).has_work  # slot 0 is empty
    empty = LoRABatch.build(slots, [], [])
    assert empty.num_tokens == 0 and empty.seg_starts.shape == (0,)


@pytest.mark.parametrize(
    ("counts", "slot_ids", "message"),
    [
        ([1, 2], [0], "2 token counts but 1 slots"),
        ([1], [2], "out of range"),
        ([1], [-2], "out of range"),
        ([-1], [0], "negative"),
    ],
)
def test_build_rejects_bad_input(config, counts, slot_ids, message):
    slots = LoRASlots(config, max_loras=2, max_rank=4)
    with pytest.raises(ValueError, match=message):
        LoRABatch.build(slots, counts, slot_ids)


def test_apply_adds_the_delta_of_each_slice(config):
    """apply() on qkv: tokens of slot 0 get x A^T (sB)^T in the k columns only; base tokens nothing."""
    slots = LoRASlots(config, max_loras=1, max_rank=4)
    adapter = random_adapter(config, ["k_proj"], rank=3, scaling=2.0)
    slots.load(0, adapter)
    batch = LoRABatch.build(slots, [2, 3], [-1, 0])
    x = torch.randn(5, config.hidden_size)
    width = config.q_size + 2 * config.kv_size
    out = torch.zeros(5, width)
    batch.layer(1).apply("qkv_proj", x, out)
    batch.layer(1).apply("down_proj", torch.randn(5, config.intermediate_size), out)  # not adapted: no-op
    w = adapter.weights[(1, "k_proj")]
    expected = torch.zeros(5, width)
    k_cols = slice(config.q_size, config.q_size + config.kv_size)
    expected[2:, k_cols] = x[2:] @ w.a.T @ (2.0 * w.b).T
    torch.testing.assert_close(out, expected)
