"""The host KV tier under tensor parallelism: one index, each rank copies its own shard.

Each rank is a thread (support/tp_threads.py) holding the real sharded model,
its KV cache of its own KV heads and its own `HostKvStore` (executor/host_kv.py)
over that cache. Every rank applies the same `KvTransfers` (the scheduler's one
index: the same block ids and host slots on every rank, as each rank receives
the same ExecuteBatch from rank 0's broadcast: executor/tp_fanout.py). A
sequence's prefix is prefilled, offloaded to a two-slot host pool, the whole
device cache is wiped (its blocks reused), the prefix is reloaded into other
block ids, and the sequence goes on (prefill with context, then decode): its
logits on 2 ranks equal one rank's doing the same, and the run that never left
the device. vLLM's CPU offloading works the same way (vllm-project/vllm,
vllm/v1/kv_offload/worker/cpu_gpu.py: each worker allocates CPU tensors shaped
like its own GPU KV caches, i.e. its own KV heads, and swaps blocks by the
block ids of the transfer spec it is handed).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support.paged_runner import random_sequences
from support.tp_threads import run_ranks
from trillium.actors.executor.host_kv import HostKvStore
from trillium.actors.protocol.execute import KvTransfers
from trillium.kernels import AttentionMetadata
from trillium.models.loader import load_model

BLOCK = 4
NUM_BLOCKS = 12
PREFIX = 8  # two blocks, offloaded and reloaded
STEPS = ((0, 8), (8, 11), (11, 12), (12, 13), (13, 14))  # (start, end) of each step's tokens


def _forward(model, caches, seq, start, end, table):
    meta = AttentionMetadata.build([end - start], [end], [table], BLOCK, device=model.device)
    with torch.inference_mode():
        hidden = model(torch.tensor(seq[start:end]), torch.arange(start, end), caches, meta)
        return model.compute_logits(hidden)


def _run(model, seq, kv_dtype, offload: bool):
    """The sequence's logits after its prefix went device -> host -> (wiped device) -> other blocks."""
    caches = model.allocate_kv_caches(NUM_BLOCKS, BLOCK, kv_dtype)
    store = HostKvStore(caches, NUM_BLOCKS, num_slots=2, block_size=BLOCK, device=torch.device("cpu"))
    table, out = [3, 7, 1, 10], []
    ints = lambda *v: np.asarray(v, dtype=np.int32)  # noqa: E731
    for start, end in STEPS:
        if offload and start == PREFIX:
            store.apply(caches, KvTransfers(save_block_ids=ints(3, 7), save_host_slots=ints(1, 0)))
            for layer in caches:  # the device blocks handed to other requests
                for t in layer:
                    t.view(torch.uint8).fill_(0x3C)
            store.apply(caches, KvTransfers(load_host_slots=ints(1, 0), load_block_ids=ints(9, 2)))
            table = [9, 2, 1, 10]
        logits = _forward(model, caches, seq, start, end, table[: -(-end // BLOCK)])
        if logits is not None:
            out.append(logits)
    return torch.cat(out) if out else None


@pytest.mark.parametrize("kv_dtype", [None, "fp8_e4m3"])
def test_offload_and_reload_per_rank_match_one_rank(checkpoint, kv_dtype):
    path = checkpoint("llama")  # GQA 4 heads / 2 KV heads: one KV head per rank
    whole, config = load_model(path, dtype="float32", progress=False)
    seq = random_sequences(config.vocab_size, lengths=(14,), seed=3)[0]
    stayed = _run(whole, seq, kv_dtype, offload=False)
    one = _run(whole, seq, kv_dtype, offload=True)

    def work(group):
        model, _ = load_model(path, dtype="float32", progress=False, tp=group)
        return _run(model, seq, kv_dtype, offload=True)

    two = run_ranks(2, work)[0]
    assert torch.equal(one, stayed)  # one rank: the reloaded prefix is the same KV
    assert (two - one).abs().max().item() < 1e-4 and torch.equal(two.argmax(-1), one.argmax(-1))


def test_the_wipe_matters_without_the_reload(checkpoint):
    """The check above can fail: skipping the reload (wiped blocks read) changes the logits."""
    path = checkpoint("llama")
    whole, config = load_model(path, dtype="float32", progress=False)
    seq = random_sequences(config.vocab_size, lengths=(14,), seed=3)[0]
    caches = whole.allocate_kv_caches(NUM_BLOCKS, BLOCK)
    first = _forward(whole, caches, seq, 0, PREFIX, [3, 7])
    for layer in caches:
        for t in layer:
            t.view(torch.uint8).fill_(0x3C)
    wiped = _forward(whole, caches, seq, PREFIX, 11, [3, 7, 1])
    stayed = _run(whole, seq, None, offload=False)
    assert first.shape[0] == PREFIX
    assert (wiped - stayed[PREFIX:11]).abs().max().item() > 1e-2
