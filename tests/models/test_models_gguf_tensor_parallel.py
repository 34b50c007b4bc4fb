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
vllm/model_executor/layers/quantization/gguf.py `GGUFLinearMethod.create_weights`:
the raw `qweight` carries `input_dim` 1 / `output_dim` 0, which the parallel
layers' weight loaders in vllm/model_executor/layers/linear.py narrow on its
bytes, the row-parallel ones dividing the row's bytes by the TP size); here an
input-dim slice that is not whole blocks is refused at start, naming the tensor.
"""

from __future__ import annotations

import pytest
import torch

from trillium.models.gguf_writer import write_gguf
from support.paged_runner import random_sequences, run_schedule
from support.tp_threads import run_ranks
from test_models_gguf_packed import greedy, llama_cpp_mix, q4_k_m_mix
from trillium.kernels import gguf_cpu
from trillium.models.loader import load_model
from trillium.models.packed_linear import GgufLinear

N_TOKENS = 8
pytestmark = pytest.mark.skipif(not gguf_cpu.available(), reason="no C compiler for the packed kernel")


@pytest.fixture(scope="module")
def quantized(checkpoint, tmp_path_factory):
    built = {}

    def get(variant: str, mix=llama_cpp_mix, **overrides):
        key = (variant, mix.__name__, tuple(sorted(overrides.items())))
        if key not in built:
            path = tmp_path_factory.mktemp(f"tpq-{variant}") / "model.gguf"
            built[key] = write_gguf(checkpoint(variant, **overrides), path, quantize=mix)
        return built[key]

    return get


def _blocks(model) -> dict[str, torch.Tensor]:
    return {name: m.blocks for name, m in model.named_modules() if isinstance(m, GgufLinear)}


# K-quants: 256-weight super-blocks, so each rank's o_proj (2 heads x 128) and down_proj (512 / 2) columns
# are exactly one; the Q6_K embedding / head and layer 0's Q6_K down_proj beside Q4_K (q4_k_m_mix).
KQUANT = {"mix": q4_k_m_mix, "hidden_size": 512, "intermediate_size": 512, "head_dim": 128}


@pytest.mark.parametrize("variant, overrides, dequantize", [
    ("llama-tied", {"vocab_size": 509}, False),  # permuted Q/K, tied Q8_0 head, the last rank's vocab rows padded
    ("llama-tied", {"vocab_size": 509}, True),
    ("qwen2", {}, False),                        # q/k/v bias; untied head
    ("qwen2", {}, True),
    ("mistral", {}, False),                      # one KV head, replicated on both ranks
    ("llama-tied", KQUANT, False),
])
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


def test_reload_refills_each_ranks_slices(quantized):
    """update_weights_from_disk / waking from sleep level 2 (loader.reload_weights) on a sharded packed
    model: every rank reads its slices again, blocks and floats back to what it loaded."""
    from trillium.models.loader import reload_weights

    path = quantized("qwen2")

    def work(group):
        model, _ = load_model(path, progress=False, tp=group)
        before = {n: t.clone() for n, t in model.state_dict().items()}
        with torch.no_grad():
            for t in model.state_dict().values():
                t.zero_()
        reload_weights(model, path, progress=False)
        return all(torch.equal(before[n], t) for n, t in model.state_dict().items())

    assert run_ranks(2, work) == [True, True]


def test_lora_on_packed_shards_matches_one_rank(quantized):
    """A LoRA adapter on all seven projections over the packed GGUF: the row-parallel packed o_proj /
    down_proj add the delta to their partial product before the one all-reduce (llama.project_with_lora),
    so 2 ranks give the one-rank packed model's logits, base and adapter requests in one batch. The
    adapter is random and in memory (support/lora_adapters.random_adapter), cut per rank as the
    manager cuts a read one (lora/tensor_parallel.shard_adapter)."""
    from support.lora_adapters import random_adapter
    from support.lora_batches import LENGTHS, SCHEDULE, run_phase
    from trillium.lora import LoRASlots
    from trillium.lora.tensor_parallel import shard_adapter

    path = quantized("qwen2")
    _, config = load_model(path, progress=False)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = random_adapter(config, modules, rank=8, scaling=0.5)
    sequences = random_sequences(config.vocab_size, lengths=LENGTHS, seed=7)
    slot_of_seq = [-1, 0, -1, 0]  # base, the adapter, base, the adapter

    def work(group=None):
        model, _ = load_model(path, progress=False, **({"tp": group} if group is not None else {}))
        assert isinstance(model.model.layers[0].mlp.down_proj, GgufLinear)
        slots = LoRASlots(model.tp.local_config, max_loras=1, max_rank=8)
        slots.load(0, shard_adapter(adapter, model.tp))
        return run_phase(model, slots, slot_of_seq, sequences)

    with torch.inference_mode():
        expected = work()
        plain = run_schedule(load_model(path, progress=False)[0], sequences, schedule=SCHEDULE)
    assert (expected[1] - plain[1]).abs().max().item() > 0.05  # the adapter really changes the outputs
    assert (expected[0] - plain[0]).abs().max().item() < 1e-4  # and base requests beside it do not
    got = run_ranks(2, work)[0]
    for ours, ref in zip(got, expected):
        assert (ours - ref).abs().max().item() < 1e-4
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("overrides, size, message", [
    # 4 ranks of 4 heads x 16: each rank's 16 o_proj columns are half a 32-weight block.
    ({}, 4, r"blk\.0\.attn_output\.weight \(Q5_0, 64 input columns\).*16 columns are not whole Q5_0 blocks of 32"),
    # K-quants at width 256: 2 ranks' 128 down_proj (and o_proj) columns are half a 256-weight super-block.
    ({"mix": q4_k_m_mix, "hidden_size": 256, "intermediate_size": 256, "head_dim": 64}, 2,
     r"blk\.0\.ffn_down\.weight \(Q6_K, 256 input columns\).*128 columns are not whole Q6_K blocks of 256"),
])
def test_split_off_a_block_boundary_is_refused_at_start(quantized, overrides, size, message):
    from trillium.config import EngineConfig

    path = quantized("llama-tied", **overrides)
    with pytest.raises(ValueError, match=f"--tensor-parallel-size {size}: GGUF tensor " + message):
        EngineConfig(model=str(path), tensor_parallel_size=size, kv_cache_memory="1MiB").resolve()
    if size == 4:  # the same file on 2 ranks (32 columns each) starts
        assert EngineConfig(model=str(path), tensor_parallel_size=2, kv_cache_memory="1MiB").resolve().num_blocks


def test_tp2_engine_serves_a_gguf_like_tp1(quantized, checkpoint):
    """The real engine, 2 rank processes over gloo, on the packed GGUF vs the one-rank model of the same
    file: the same greedy tokens, top-5 logprobs within 1e-3 (vLLM compares TP=2 with TP=1 this way:
    vllm-project/vllm, tests/models/utils.py check_logprobs_close). WHY the reference is not a second
    engine: one engine start is most of this test's time; the one-rank engine's forward is this model's."""
    from trillium import LLM, SamplingParams

    path = quantized("llama-tied", vocab_size=509)
    tokenizer = str(checkpoint("llama-tied", vocab_size=509))  # the synthetic GGUF carries no tokenizer
    prompts = [[5, 17, 99, 250, 31], [400, 3, 77, 12, 8, 190, 44]]
    whole, _ = load_model(path, progress=False)
    tokens = greedy(whole, prompts, N_TOKENS)
    full = [p + t for p, t in zip(prompts, tokens)]
    logits = run_schedule(whole, full, schedule=(tuple((i, len(seq)) for i, seq in enumerate(full)),), num_blocks=64)
    expected = [torch.log_softmax(rows[len(p) - 1: -1], -1)  # the distribution each token was drawn from
                for p, rows in zip(prompts, logits)]
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True, logprobs=5)
    with LLM(str(path), tokenizer=tokenizer, tensor_parallel_size=2, num_blocks=32, max_num_seqs=4) as llm:
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    for out, want, ref in zip(outs, tokens, expected):
        assert list(out.token_ids) == want
        for step, got in enumerate(out.logprobs):
            top = torch.topk(ref[step], 5)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                assert abs(got[token].logprob - logprob) < 1e-3
