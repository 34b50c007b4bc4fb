"""Multi-LoRA forward vs transformers + peft, and adapter validation errors.

Three PEFT adapters (support/lora_adapters.py) on the synthetic Llama checkpoint (hidden 64, 2 layers):

    attn   r=8,  alpha=16, q/k/v/o_proj
    mlp    r=4,  alpha=8,  gate/up/down_proj
    all    r=16, alpha=12, all seven, rsLoRA

Our model serves them from `LoRASlots(max_loras=2)` in mixed batches (base
requests next to requests of two adapters: ragged prefill, chunked prefill
with context, decode), reloading slot 0 between phases, and each request's
logits must match transformers + peft for its adapter (or the plain model).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from support.lora_adapters import ADAPTERS, copy_adapter, make_peft_adapter
from support.lora_batches import LENGTHS, SCHEDULE, run_phase
from support.paged_runner import hf_logits, load_hf, max_abs_diff, random_sequences, run_schedule
from trillium.lora import AdapterError, LoRASlots, load_adapter
from trillium.models import load_model

pytest.importorskip("peft")

MAX_RANK = 16

@pytest.fixture(scope="module")
def llama(checkpoint):
    path = checkpoint("llama")
    model, config = load_model(path, progress=False)
    return path, model, config


@pytest.fixture(scope="module")
def adapter_dirs(llama, tmp_path_factory) -> dict[str, Path]:
    path = llama[0]
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_peft_adapter(path, root / name, seed, **kw) for seed, (name, kw) in enumerate(ADAPTERS.items())}


def peft_logits(base_path: Path, adapter_dir: Path | None, sequences: list[list[int]]) -> list[torch.Tensor]:
    """transformers (+ peft adapter) full-sequence logits: the oracle."""
    model = load_hf(base_path)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    return hf_logits(model, sequences)


def assert_matches(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert max_abs_diff([ours], [ref]) < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))  # greedy next tokens


def test_mixed_batches_match_peft(llama, adapter_dirs):
    path, model, config = llama
    sequences = random_sequences(config.vocab_size, lengths=LENGTHS, seed=4)
    adapters = {name: load_adapter(d, config, MAX_RANK) for name, d in adapter_dirs.items()}
    assert adapters["all"].scaling == pytest.approx(12 / 4)  # rsLoRA: alpha / sqrt(16)
    assert adapters["attn"].scaling == pytest.approx(16 / 8)
    oracle = {name: peft_logits(path, d, sequences) for name, d in adapter_dirs.items()}
    oracle["base"] = peft_logits(path, None, sequences)
    for name in ADAPTERS:  # the adapters really change the outputs
        assert max_abs_diff(oracle[name], oracle["base"]) > 0.05

    slots = LoRASlots(config, max_loras=2, max_rank=MAX_RANK, dtype=torch.float32)
    phases = [
        # (adapter to load into slot 0 first, per-sequence (slot, oracle name))
        ("attn", [(-1, "base"), (0, "attn"), (0, "attn"), (1, "mlp")]),
        ("all", [(0, "all"), (-1, "base"), (1, "mlp"), (0, "all")]),  # slot 0 reloaded with a bigger adapter
        ("attn", [(1, "mlp"), (0, "attn"), (-1, "base"), (0, "attn")]),  # and back: rank 16 -> 8 leaves no trace
    ]
    slots.load(1, adapters["mlp"])
    for slot0_adapter, assignment in phases:
        slots.load(0, adapters[slot0_adapter])
        ours = run_phase(model, slots, [slot for slot, _ in assignment], sequences)
        for seq, (_, name) in enumerate(assignment):
            assert_matches(ours[seq], oracle[name][seq])


def test_no_lora_and_all_base_batches_match_plain_model(llama, adapter_dirs):
    path, model, config = llama
    sequences = random_sequences(config.vocab_size, lengths=LENGTHS, seed=5)
    plain = run_schedule(model, sequences, schedule=SCHEDULE)
    slots = LoRASlots(config, max_loras=2, max_rank=MAX_RANK, dtype=torch.float32)
    slots.load(0, load_adapter(adapter_dirs["all"], config, MAX_RANK))
    all_base = run_phase(model, slots, [-1, -1, -1, -1], sequences)
    for a, b in zip(plain, all_base):
        assert torch.equal(a, b)
    ref = peft_logits(path, None, sequences)
    assert max_abs_diff(plain, ref) < 1e-4


def test_cleared_slot_serves_the_base_model(llama, adapter_dirs):
    _, model, config = llama
    sequences = random_sequences(config.vocab_size, lengths=LENGTHS, seed=6)
    slots = LoRASlots(config, max_loras=2, max_rank=MAX_RANK, dtype=torch.float32)
    slots.load(1, load_adapter(adapter_dirs["all"], config, MAX_RANK))
    slots.clear(1)
    assert slots.targets(1) == frozenset()
    ours = run_phase(model, slots, [1, 1, -1, 1], sequences)
    plain = run_schedule(model, sequences, schedule=SCHEDULE)
    for a, b in zip(ours, plain):
        assert torch.equal(a, b)


# ---- adapter errors ------------------------------------------------------------------


def test_rank_over_max_is_rejected(llama, adapter_dirs):
    config = llama[2]
    with pytest.raises(AdapterError, match="rank 16 exceeds max_lora_rank 8"):
        load_adapter(adapter_dirs["all"], config, max_rank=8)
    load_adapter(adapter_dirs["attn"], config, max_rank=8)  # rank 8 fits exactly


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (["q_proj", "lm_head"], "'lm_head' is not supported"),
        (["embed_tokens"], "'embed_tokens' is not supported"),
        (["q_proj", "qkv_magic"], "'qkv_magic' does not exist"),
        (["mlp.q_proj"], "'mlp.q_proj' does not exist"),
        (r".*\.(q_proj|norm)", "matches 'model.norm'"),
        (r".*\.nothing_here", "matches no module"),
        ([], "non-empty list"),
    ],
)
def test_unsupported_target_modules_are_rejected(llama, adapter_dirs, tmp_path, targets, message):
    broken = copy_adapter(adapter_dirs["attn"], tmp_path / "a", target_modules=targets)
    with pytest.raises(AdapterError, match=message):
        load_adapter(broken, llama[2], MAX_RANK)


def test_target_regex_and_all_linear_are_accepted(llama, adapter_dirs, tmp_path):
    config = llama[2]
    regex = copy_adapter(adapter_dirs["attn"], tmp_path / "regex", target_modules=r".*\.(q|k|v|o)_proj")
    assert load_adapter(regex, config, MAX_RANK).target_modules == {"q_proj", "k_proj", "v_proj", "o_proj"}
    all_linear = copy_adapter(adapter_dirs["all"], tmp_path / "all", target_modules="all-linear")
    assert len(load_adapter(all_linear, config, MAX_RANK).target_modules) == 7


def test_peft_lm_head_adapter_is_rejected(llama, tmp_path):
    path, _, config = llama
    adapter = make_peft_adapter(
        path, tmp_path / "head", seed=9, r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]
    )
    with pytest.raises(AdapterError, match="lm_head"):
        load_adapter(adapter, config, MAX_RANK)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias='all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "not LORA"),
        ({"r": 0}, "positive integer"),
        ({"lora_alpha": "big"}, "lora_alpha"),
    ],
)
def test_unsupported_config_settings_are_rejected(llama, adapter_dirs, tmp_path, changes, message):
    broken = copy_adapter(adapter_dirs["attn"], tmp_path / "a", **changes)
    with pytest.raises(AdapterError, match=message):
        load_adapter(broken, llama[2], MAX_RANK)


def test_bin_only_adapter_is_refused(llama, adapter_dirs, tmp_path):
    broken = copy_adapter(adapter_dirs["attn"], tmp_path / "a")
    (broken / "adapter_model.safetensors").unlink()
    (broken / "adapter_model.bin").write_bytes(b"not unpickled, ever")
    with pytest.raises(AdapterError, match="only adapter_model.bin found; pickle"):
        load_adapter(broken, llama[2], MAX_RANK)


def test_missing_or_malformed_files_are_rejected(llama, adapter_dirs, tmp_path):
    config = llama[2]
    no_config = copy_adapter(adapter_dirs["attn"], tmp_path / "no_config")
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="missing adapter_config.json"):
        load_adapter(no_config, config, MAX_RANK)
    bad_json = copy_adapter(adapter_dirs["attn"], tmp_path / "bad_json")
    (bad_json / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        load_adapter(bad_json, config, MAX_RANK)
    no_weights = copy_adapter(adapter_dirs["attn"], tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="missing adapter_model.safetensors"):
        load_adapter(no_weights, config, MAX_RANK)
    corrupt = copy_adapter(adapter_dirs["attn"], tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(AdapterError, match="cannot read safetensors"):
        load_adapter(corrupt, config, MAX_RANK)
    with pytest.raises(AdapterError, match="not a directory"):
        load_adapter(tmp_path / "nowhere", config, MAX_RANK)


def _edit_tensors(adapter_dir: Path, edit) -> None:
    file = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


A_NAME = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.update({A_NAME: torch.zeros(8, 65)}),
            r"layer 1 v_proj: lora_A has shape \(8, 65\), expected \(8, 64\)",
        ),
        (lambda t: t.update({A_NAME.replace("lora_A", "lora_B"): torch.zeros(33, 8)}), r"lora_B has shape \(33, 8\)"),
        (lambda t: t.pop(A_NAME), "has lora_B but not its pair"),
        (lambda t: t.update({A_NAME.replace("layers.1", "layers.7"): torch.zeros(8, 64)}), "layer 7; the model has 2"),
        (lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}), "not a LoRA weight"),
        (lambda t: t.update({A_NAME.replace("lora_A.weight", "lora_magnitude_vector"): torch.zeros(32)}), "DoRA"),
        (lambda t: t.update({A_NAME: torch.zeros(8, 64, dtype=torch.int32)}), "expected a float type"),
    ],
    ids=["wrong_in", "wrong_out", "unpaired", "layer_out_of_range", "lm_head_tensor", "dora_tensor", "int_tensor"],
)
def test_bad_tensors_are_rejected(llama, adapter_dirs, tmp_path, edit, message):
    broken = copy_adapter(adapter_dirs["attn"], tmp_path / "a")
    _edit_tensors(broken, edit)
    with pytest.raises(AdapterError, match=message):
        load_adapter(broken, llama[2], MAX_RANK)


def test_adapter_name_segment_is_tolerated(llama, adapter_dirs, tmp_path):
    config = llama[2]
    renamed = copy_adapter(adapter_dirs["mlp"], tmp_path / "a")
    _edit_tensors(renamed, lambda t: t.update({k.replace(".weight", ".default.weight"): t.pop(k) for k in list(t)}))
    original = load_adapter(adapter_dirs["mlp"], config, MAX_RANK)
    adapter = load_adapter(renamed, config, MAX_RANK)
    assert adapter.weights.keys() == original.weights.keys()
    for key, w in adapter.weights.items():
        assert torch.equal(w.a, original.weights[key].a) and torch.equal(w.b, original.weights[key].b)
