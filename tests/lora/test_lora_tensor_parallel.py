"""LoRA under tensor parallelism: every rank's shard of the adapters computes transformers + peft.

Each rank is a thread (support/tp_threads.py) holding the real sharded model
(`load_model(..., tp=group)`) and its own `LoRAManager` with that model's
`TpShard`: the adapter is read and validated whole, then the rank keeps its
slice of A and B (lora/tensor_parallel.py). The layout mirrors vLLM's
(vllm-project/vllm, vllm/lora/layers/column_parallel_linear.py: B sliced by
rank for q/k/v and gate/up, A whole, KV heads by tp_rank // replicas;
vllm/lora/layers/row_parallel_linear.py: A sliced on the input dim for o_proj
and down_proj, B whole, the delta inside the partial sum that the layer's
all-reduce adds up). Compared: every position's logits of mixed batches
(base requests beside two adapters, prefill, chunked prefill, decode)
against transformers + peft, on 2 ranks (one KV head each) and 4 (each KV
head replicated on two ranks).
"""

from __future__ import annotations

import pytest
import torch

from support.lora_adapters import ADAPTERS, make_peft_adapter
from support.lora_batches import LENGTHS, run_phase
from support.paged_runner import hf_logits, load_hf, max_abs_diff, random_sequences
from support.tp_threads import run_ranks
from trillium.lora.manager import LoRAManager
from trillium.models.loader import load_model

pytest.importorskip("peft")

MAX_RANK = 16


@pytest.fixture(scope="module")
def setup(checkpoint, tmp_path_factory):
    from peft import PeftModel

    path = checkpoint("llama")  # GQA 4 heads / 2 KV heads, 2 layers
    root = tmp_path_factory.mktemp("tp-adapters")
    dirs = {name: make_peft_adapter(path, root / name, seed, **ADAPTERS[name])
            for seed, name in enumerate(("all", "mlp"))}
    _, config = load_model(path, progress=False)
    sequences = random_sequences(config.vocab_size, lengths=LENGTHS, seed=7)
    oracle = {"base": hf_logits(load_hf(path), sequences)}
    for name, d in dirs.items():
        oracle[name] = hf_logits(PeftModel.from_pretrained(load_hf(path), str(d)).eval(), sequences)
        assert max_abs_diff(oracle[name], oracle["base"]) > 0.05  # the adapter really changes the outputs
    return path, dirs, sequences, oracle


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_adapters_match_peft(setup, size):
    path, dirs, sequences, oracle = setup
    order = [("base", -1), ("all", 1), ("mlp", 2), ("all", 1)]  # per request: oracle, lora_id (-1: none)

    def work(group):
        model, config = load_model(path, dtype="float32", progress=False, tp=group)
        manager = LoRAManager(config, max_loras=2, max_rank=MAX_RANK, max_cpu_loras=2, dtype=torch.float32,
                              tp_shard=model.tp)
        manager.register(1, "all", str(dirs["all"]))
        manager.register(2, "mlp", str(dirs["mlp"]))
        manager.batch([1, 2], [1, 1])  # both into slots
        slot = manager.resident
        a = manager.slots.layers[0]["o_proj"].a
        assert a.shape[-1] == config.q_size // size  # o_proj's A holds this rank's heads' columns only
        return run_phase(model, manager.slots, [slot.get(i, -1) for _, i in order], sequences)

    got = run_ranks(size, work)[0]
    for seq, (name, _) in enumerate(order):
        assert max_abs_diff([got[seq]], [oracle[name][seq]]) < 1e-4
        assert torch.equal(got[seq].argmax(-1), oracle[name][seq].argmax(-1))
