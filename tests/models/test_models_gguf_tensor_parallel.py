"""GGUF checkpoints sharded over tensor-parallel ranks: each rank reads its rows / whole blocks.

Ranks are threads (support/tp_threads.py) holding the real sharded model that
`load_model(gguf, tp=group)` builds; the collectives are exchanged in
memory. A quantized synthetic GGUF (llama.cpp's mix of formats:
test_models_gguf_packed.py `llama_cpp_mix`) served on 2 ranks computes the
one-rank model's logits, packed (the C kernel on each rank's blocks) and
with `gguf_dequantize=True`; each rank's packed blocks are exactly its
slice of the one-rank blocks (rows for column-parallel layers, whole blocks
of the input dim for row-parallel ones), so no rank holds more than its
share. vLLM shards GGUF the same way (vllm-project/vllm,
vllm/model_executor/layers/quantization/gguf.py: `qweight` carries
`input_dim` / `output_dim` and is narrowed in bytes of whole blocks by the
parallel linear layers' weight loaders); an input-dim slice that is not whole
blocks is refused at start here, naming the tensor.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from support.gguf_writer import write_gguf
from support.paged_runner import random_sequences, run_schedule
from support.tp_threads import run_ranks
from test_models_gguf_packed import llama_cpp_mix
from trillium.kernels import gguf_cpu
from trillium.models.loader import load_model
from trillium.models.packed_linear import GgufLinear

pytestmark = pytest.mark.skipif(not gguf_cpu.available(), reason="no C compiler for the packed kernel")


@pytest.fixture(scope="module")
def quantized(checkpoint, tmp_path_factory):
    def get(variant: str, **overrides):
        path = tmp_path_factory.mktemp(f"tpq-{variant}") / "model.gguf"
        return write_gguf(checkpoint(variant, **overrides), path, quantize=llama_cpp_mix)

    return get


def _blocks(model) -> dict[str, torch.Tensor]:
    return {name: m.blocks for name, m in model.named_modules() if isinstance(m, GgufLinear)}


@pytest.mark.parametrize("variant, overrides", [
    ("llama-tied", {"vocab_size": 509}),  # permuted Q/K, tied Q8_0 head, the last rank's vocab rows padded
    ("qwen2", {}),                        # q/k/v bias; untied head
    ("mistral", {}),                      # one KV head, replicated on both ranks
])
@pytest.mark.parametrize("dequantize", [False, True])
def test_gguf_shards_compute_the_whole_model(quantized, variant, overrides, dequantize):
    path = quantized(variant, **overrides)
    whole, config = load_model(path, progress=False, gguf_dequantize=dequantize)
    sequences = random_sequences(config.vocab_size, seed=5)
    expected = run_schedule(whole, sequences, num_blocks=32)

    def work(group):
        model, _ = load_model(path, progress=False, gguf_dequantize=dequantize, tp=group)
        return run_schedule(model, sequences, num_blocks=32), _blocks(model)

    ranks = run_ranks(2, work)
    for ours, ref in zip(ranks[0][0], expected):  # prefill, chunked prefill and decode steps (<= 32 rows: kernel)
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() < 1e-4
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    full = _blocks(whole)
    assert bool(full) != dequantize and all(bool(r[1]) != dequantize for r in ranks)
    if not dequantize:
        _assert_blocks_are_slices(full, [r[1] for r in ranks], config)


def _assert_blocks_are_slices(full, ranks, config):
    """Rank r's blocks are its rows (q/k/v, gate/up, head) or its whole input blocks (o_proj, down_proj)."""
    assert set(ranks[0]) == set(ranks[1]) == set(full)
    for name, blocks in full.items():
        if name.endswith(("o_proj", "down_proj")):
            width = blocks.shape[1] // 2  # bytes of each rank's columns
            for r, rank in enumerate(ranks):
                assert torch.equal(rank[name], blocks[:, r * width:(r + 1) * width])
        elif name == "lm_head":
            rows = -(-config.vocab_size // 2)
            for r, rank in enumerate(ranks):
                piece = blocks[r * rows:(r + 1) * rows]
                assert torch.equal(rank[name][: piece.shape[0]], piece) and not rank[name][piece.shape[0]:].any()
        elif name.endswith("gate_up_proj"):
            inter = config.intermediate_size
            for r, rank in enumerate(ranks):
                mine = [blocks[part * inter + r * inter // 2:][: inter // 2] for part in (0, 1)]
                assert torch.equal(rank[name], torch.cat(mine))
        else:  # qkv_proj: each rank holds its heads' rows, fewer bytes than the whole
            assert all(rank[name].shape[1] == blocks.shape[1] and rank[name].shape[0] < blocks.shape[0]
                       for rank in ranks)


def test_split_off_a_block_boundary_is_refused_at_start(quantized):
    """4 ranks of 4 heads x 16: each rank's 16 o_proj columns are half a 32-weight block."""
    from trillium.config import EngineConfig

    path = quantized("llama-tied")
    with pytest.raises(ValueError, match=r"blk\.0\.attn_output\.weight \(Q5_0, 64 input columns\).*"
                                         r"each rank's 16 columns are not whole Q5_0 blocks of 32"):
        EngineConfig(model=str(path), tensor_parallel_size=4, kv_cache_memory="1MiB").resolve()
    # The same file on 2 ranks (32 columns each) starts.
    assert EngineConfig(model=str(path), tensor_parallel_size=2, kv_cache_memory="1MiB").resolve().num_blocks > 0
