"""Compiled decode (executor/compiled_decode.py): the one test that compiles.

A real ExecutorCore with `enforce_eager=False` and two buckets (2 through
Inductor's C++ wrapper, 4 through its Python wrapper) against an eager core on
the same checkpoint, both driven by the real scheduler core: greedy tokens
identical to eager and to transformers (3 requests: decode steps of 3 rows
padded to 4, then 1-2 rows as they finish, in bucket 2), then a live
weight update (in-place copy, and a `param.data` swap as shadow weights and
sleep do) must change the compiled tokens exactly as it changes eager ones:
the graph holds no stale weights. The same run under --async-scheduling (two
steps in flight, each result taken after the next step was planned) gives the
same tokens, every decode step in the graph, and no recompile. With ngram
speculation (k=3), verify steps of 4 tokens (the last token and 3 drafts) run
the same bucket's graph, greedy output identical to eager speculation and to
plain decoding. A GGUF checkpoint kept packed (Q4_1 / Q4_0 / Q8_0 blocks through `trillium::gguf_linear`) compiles too (C++ wrapper): the same tokens as
eager, and a reload copying other blocks in is seen by the graph. Where the C++ ops build, pure
decode steps run native decode (models/native_decode.py, one C++ call) instead of the graph: each
test above also checks it took them, and with it switched off the graphs give the same tokens and bits.

Mirrors vLLM's habit of compiling decode at fixed batch sizes and padding a
batch to the next one (vllm/config/compilation.py `cudagraph_capture_sizes`,
vllm/v1/worker/gpu_model_runner.py pads num_input_tokens to the next size).
"""

from __future__ import annotations

import os
import time

import attrs
import numpy as np
import pytest
import torch

from support.oracles import hf_greedy, transformers_model
from trillium.actors.executor.compiled_decode import CompiledDecode
from trillium.actors.executor.core import ExecutorCore
from trillium.actors.protocol.requests import AddRequest
from trillium.actors.scheduler.core import build_scheduler
from trillium.config import EngineConfig
from trillium.kernels import AttentionMetadata, native_ops
from trillium.sampling_params import SamplingParams

PROMPTS = {"a": [5, 9, 13, 2, 7], "b": list(range(10, 40)), "c": [3] * 21}
MAX_TOKENS = {"a": 8, "b": 6, "c": 4}  # finish at different steps: decode batches of 3, 2, 1


def _config(path, enforce_eager: bool, sizes=(4,), cpp_max=2, **extra) -> EngineConfig:
    """Buckets `sizes`, those up to `cpp_max` through Inductor's C++ wrapper, the others its Python one."""
    return EngineConfig.build(model=str(path), kv_cache_memory="4MiB", enforce_eager=enforce_eager,
                              compile_batch_sizes=sizes, compile_cpp_wrapper_max_batch=cpp_max, **extra).resolve()


@pytest.fixture(scope="module")
def cores(checkpoint):
    path = checkpoint("llama")
    torch.set_num_threads(1)
    return ExecutorCore(_config(path, False, sizes=(2, 4))), ExecutorCore(_config(path, True)), path


def _greedy(core: ExecutorCore, prompts=PROMPTS, speculative: bool = True, async_scheduling: bool = False,
            ahead: list | None = None) -> dict[str, list[int]]:
    scheduler = build_scheduler(attrs.evolve(core.config, async_scheduling=async_scheduling))
    for rid, prompt in prompts.items():
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS.get(rid, 8), ignore_eos=True,
                                speculative=speculative)
        scheduler.add_request(AddRequest(request_id=rid, prompt_token_ids=np.array(prompt, np.int32),
                                         sampling=params, eos_token_ids=(2,), arrival_time=time.time()))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    in_flight = []  # results not taken yet, oldest first (--async-scheduling: up to two)
    while scheduler.has_work() or in_flight:
        while not in_flight or scheduler.may_schedule_ahead:
            batch = scheduler.schedule()
            if batch is None:
                break
            if in_flight and ahead is not None:
                ahead.append(batch.step_id)  # planned while the previous step was out
            in_flight.append(core.execute(batch))  # the executor runs batches in the order sent
        if not in_flight:
            break
        # deltas carry every new token, a verified run's accepted drafts included
        for delta in scheduler.update_from_output(in_flight.pop(0)).deltas:
            out[delta.request_id].extend(delta.new_token_ids)
    return out


def test_compiled_greedy_matches_eager_and_transformers_then_follows_weight_updates(cores):
    from torch._dynamo.utils import counters  # WHY here: importing dynamo at collection costs every run

    compiled, eager, path = cores
    assert isinstance(compiled.forward, CompiledDecode) and not isinstance(eager.forward, CompiledDecode)
    # bucket 2 (steps of 1-2 rows) through Inductor's C++ wrapper, bucket 4 (3 rows) its Python one
    assert compiled.forward.compile_s.keys() == {2, 4} and compiled.forward.cpp_wrapper_sizes == (2,)
    graphs = counters["stats"]["unique_graphs"]  # compiled at start; nothing recompiles after
    forward = compiled.forward
    assert (forward.native_decode is not None) == native_ops.load()  # the plain Llama: native decode
    before = _greedy(compiled)
    assert forward.num_compiled_steps >= 7  # every decode step of the run (3, 2, 2, 1, 1, 1, 1 rows)
    assert forward.num_native_steps == (forward.num_compiled_steps if forward.native_decode else 0)
    assert before == _greedy(eager)
    native, forward.native_decode = forward.native_decode, None  # the graphs themselves run decode
    try:
        steps = forward.num_native_steps
        assert _greedy(compiled) == before and forward.num_native_steps == steps
    finally:
        forward.native_decode = native
    # --async-scheduling: the step planned ahead feeds the token the executor has just sampled
    # into the same graphs (same padded buffers, dtypes, bucket); no recompile, no eager fallback.
    steps = compiled.forward.num_compiled_steps
    ahead: list[int] = []
    assert _greedy(compiled, async_scheduling=True, ahead=ahead) == before
    assert len(ahead) >= 5  # the decode steps did go out two at a time
    assert compiled.forward.num_compiled_steps >= steps + 7
    hf = transformers_model(path)
    for rid, prompt in PROMPTS.items():
        assert before[rid] == hf_greedy(hf, prompt, MAX_TOKENS[rid])[0]

    # A live update (load_weights copies in place) and a storage swap (param.data =, as shadow weights do).
    steps = compiled.forward.num_compiled_steps
    generator = torch.Generator().manual_seed(1)
    for core in (compiled, eager):
        params = dict(core.model.named_parameters())
        down = params["model.layers.0.mlp.down_proj.weight"]
        core.model.load_weights([("model.layers.0.mlp.down_proj.weight", down * -3.0)])
        gate_up = params["model.layers.1.mlp.gate_up_proj.weight"]
        gate_up.data = gate_up.data + torch.randn(gate_up.shape, generator=generator.manual_seed(1)) * 0.5
    after = _greedy(compiled)
    assert compiled.forward.num_compiled_steps > steps  # still compiled, not an eager fallback
    assert after != before
    assert after == _greedy(eager)
    assert counters["stats"]["unique_graphs"] == graphs
    # Those steps ran natively (models/native_decode.py) or the bucket's bytecode without guard
    # evaluation (direct_dispatch.py), through the C++ ops where they build (kernels/native_ops.py)
    assert compiled.forward.num_direct_steps + compiled.forward.num_native_steps == compiled.forward.num_compiled_steps
    assert compiled.forward.native == native_ops.load()


def test_a_compiled_row_has_the_bits_of_the_same_row_run_eagerly(cores):
    """Bit for bit, not just the same greedy tokens: the hidden states of a decode step of 3 rows (natively,
    models/native_decode.py, and padded to the 4-row graph), of one of 5 rows (past the largest bucket:
    natively), and of a verify step of 4 rows (one sequence's token and 3 drafts) equal the
    eager forward's on the same cache. WHY it matters: a request's steps run in a graph or eagerly
    depending on what shares them (prefill chunks, a verify step past the largest bucket), so any
    rounding difference lets a late greedy near-tie follow the batch (dispatch.py's opaque row-wise
    ops: Inductor's own fused norms, rope and SiLU rounded otherwise)."""
    compiled = cores[0]
    model, forward = compiled.model, compiled.forward
    assert max(forward.compiled_sizes) == 4
    block_size, vocab = compiled.config.block_size, compiled.model_config.vocab_size
    caches = model.allocate_kv_caches(24, block_size)
    generator = torch.Generator().manual_seed(7)
    lens = [5, 9, 2 * block_size + 3, 7, 12]
    tables, first = [], 1
    for n in lens:  # each sequence's blocks, room for 4 more tokens
        count = -(-(n + 4) // block_size)
        tables.append(list(range(first, first + count)))
        first += count
    ids = torch.randint(0, vocab, (sum(lens),), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        model(ids, positions, caches, AttentionMetadata.build(lens, lens, tables, block_size))  # prefill, eager
        steps = [  # (query lens, verify rows)
            ([1, 1, 1], False),
            ([1] * 5, False),  # past the largest bucket (4): native decode takes it, a graph could not
            ([4], True),
        ]
        for query_lens, verify in steps:
            seqs = range(len(query_lens))
            seq_lens = [lens[i] + q for i, q in zip(seqs, query_lens)]
            meta = AttentionMetadata.build(query_lens, seq_lens, [tables[i] for i in seqs], block_size,
                                           verify_rows=verify)
            step_ids = torch.randint(0, vocab, (sum(query_lens),), generator=generator)
            step_pos = torch.cat([torch.arange(lens[i], lens[i] + q) for i, q in zip(seqs, query_lens)])
            eager = model(step_ids, step_pos, caches, meta)
            native = forward.native_decode
            # a decode step runs natively (models/native_decode.py) where the native ops build, and
            # through the graph with native decode off; a verify step always through the graph
            if native is None and len(query_lens) > max(forward.compiled_sizes):
                continue  # eager would run it: nothing compiled to compare
            runners = ["native"] if native is not None and not verify else []
            runners += ["graph"] if sum(query_lens) <= max(forward.compiled_sizes) else []
            for runner in runners:
                forward.native_decode = native if runner == "native" else None
                before, natively = forward.num_compiled_steps, forward.num_native_steps
                try:
                    graph = forward(step_ids, step_pos, caches, meta)
                finally:
                    forward.native_decode = native
                assert forward.num_compiled_steps == before + 1  # it did not run eager
                assert forward.num_native_steps == natively + (runner == "native")
                assert torch.equal(graph, eager), (runner, query_lens, (graph - eager).abs().max())
                assert torch.equal(model.compute_logits(graph), model.compute_logits(eager))


def test_native_decode_refuses_what_it_does_not_take_before_writing_anything(cores):
    """Native decode (models/native_decode.py) answers None, caches untouched, for a token id outside
    the vocabulary, a position outside the rope table, more rows than the linears take, or a step the
    native attention was not set for; the caller then runs the graph (whose ops raise or fall back)."""
    compiled = cores[0]
    native = compiled.forward.native_decode
    if native is None:
        pytest.skip(f"no native decode: {native_ops.unavailable_reason()}")
    model, block_size = compiled.model, compiled.config.block_size
    vocab, table_rows = compiled.model_config.vocab_size, model.cos_sin_cache.shape[0]
    caches = model.allocate_kv_caches(8, block_size)
    for cache in caches:
        cache.k_cache.fill_(0.25), cache.v_cache.fill_(0.5)
    snapshot = [(c.k_cache.clone(), c.v_cache.clone()) for c in caches]
    meta = AttentionMetadata.build([1, 1], [4, 6], [[1], [2]], block_size)
    step = compiled.forward.context.native_step
    good_ids, good_pos = torch.tensor([3, 4]), torch.tensor([3, 5])
    cases = [(torch.tensor([3, vocab]), good_pos), (good_ids, torch.tensor([3, table_rows])),
             (good_ids[:1], good_pos[:1])]  # one row for a step set for two
    with torch.inference_mode():
        for ids, pos in cases:
            assert step.set(caches, meta)
            try:
                assert native(ids, pos, step) is None
            finally:
                step.clear()
        assert native(good_ids, good_pos, step) is None  # cleared: no step set
        many = AttentionMetadata.build([1] * (native.max_rows + 1), [4] * (native.max_rows + 1),
                                       [[1]] * (native.max_rows + 1), block_size)
        assert step.set(caches, many)
        try:
            assert native(torch.full((native.max_rows + 1,), 3), torch.full((native.max_rows + 1,), 3), step) is None
        finally:
            step.clear()
    for cache, (k, v) in zip(caches, snapshot):
        assert torch.equal(cache.k_cache, k) and torch.equal(cache.v_cache, v)
    assert step.set(caches, meta)
    try:
        with torch.inference_mode():
            assert native(good_ids, good_pos, step) is not None  # and a good step does write
    finally:
        step.clear()
    assert not torch.equal(caches[0].k_cache, snapshot[0][0])


def test_speculative_verify_steps_run_the_compiled_graph_with_eager_tokens(cores, monkeypatch):
    """Batch 1 with speculation (k=3): verify steps of 4 tokens (the last token and 3 drafts, bucket
    4) run the compiled graph, and the tokens equal eager speculation's and plain compiled decoding's
    (the same core, the request opting out). The
    drafts: the plain greedy continuation itself, every other step with its last draft wrong (a
    random model's text gives prompt lookup nothing to find), so both acceptance and rejection run."""
    from trillium.speculative.proposer import NgramProposer

    path = cores[2]  # NOTE: not the cores themselves: the test above changed their weights
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    compiled = ExecutorCore(_config(path, False, speculative_config=spec))
    eager = ExecutorCore(_config(path, True, speculative_config=spec))
    for rid, prompt in (("a", PROMPTS["a"]), ("b", PROMPTS["b"])):
        verified = compiled.forward.num_compiled_verify_steps
        # NOTE: request ids new to each core run (a core keeps a finished request's state until
        # a next step would tell it, and this loop has none).
        plain = _greedy(compiled, {"plain-" + rid: prompt}, speculative=False)["plain-" + rid]  # it opts out
        assert compiled.forward.num_compiled_verify_steps == verified
        calls = []

        def propose(self, token_ids, max_tokens, plain=plain, prompt=prompt, calls=calls):
            done = len(token_ids) - len(prompt)
            drafts = plain[done : done + max_tokens]
            calls.append(len(drafts))
            if len(calls) % 2 == 0 and len(drafts) == 3:
                drafts[-1] = (drafts[-1] + 1) % compiled.model_config.vocab_size
            return drafts

        monkeypatch.setattr(NgramProposer, "propose", propose)
        assert _greedy(compiled, {"spec-" + rid: prompt})["spec-" + rid] == plain  # 8 tokens each
        assert _greedy(eager, {"spec-" + rid: prompt})["spec-" + rid] == plain
        assert len(calls) >= 2
    assert compiled.forward.num_compiled_verify_steps >= 3


def test_packed_gguf_decode_compiles_with_eager_tokens(checkpoint, tmp_path):
    """A packed GGUF model (Q4_1, Q4_0 and Q8_0 blocks) runs its decode steps in the
    compiled graph, its projections through trillium::gguf_linear, with the eager core's tokens; blocks
    copied in place (a reload from disk, packed_linear.install_packed) change both alike."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    from trillium.models.gguf_writer import write_gguf
    from trillium.kernels import gguf_cpu
    from trillium.models.packed_linear import GgufLinear

    if not gguf_cpu.available():
        pytest.skip(f"no packed kernel: {gguf_cpu.unavailable_reason()}")
    def mix(name: str):  # as test_models_gguf_packed.llama_cpp_mix: Q8_0 embedding / head, Q4_0 down, Q4_1 rest
        return Q.Q8_0 if name.startswith(("token_embd", "output.")) else Q.Q4_0 if ".ffn_down." in name else Q.Q4_1

    gguf = write_gguf(checkpoint("llama"), tmp_path / "model.gguf", quantize=mix)
    compiled, eager = ExecutorCore(_config(gguf, False, cpp_max=4)), ExecutorCore(_config(gguf, True))
    assert isinstance(compiled.forward, CompiledDecode)
    packed = [m for m in compiled.model.modules() if isinstance(m, GgufLinear)]
    assert {m.format_name for m in packed} >= {"Q4_1", "Q4_0", "Q8_0"}
    before = _greedy(compiled)
    assert compiled.forward.num_compiled_steps >= 7
    # the packed linears from native decode's C++ loop too (models/native_decode.py)
    assert compiled.forward.num_native_steps == (compiled.forward.num_compiled_steps if native_ops.load() else 0)
    assert before == _greedy(eager)
    for core in (compiled, eager):  # layer 0's gate/up blocks reversed row-wise: other weights, same format
        layer = core.model.model.layers[0].mlp.gate_up_proj
        assert isinstance(layer, GgufLinear)
        layer.blocks.copy_(layer.blocks.flip(0))
    steps = compiled.forward.num_compiled_steps
    after = _greedy(compiled)
    assert compiled.forward.num_compiled_steps > steps
    assert after != before
    assert after == _greedy(eager)
    assert compiled.forward.direct_invalidated is None  # blocks copied in: nothing structural

    # A structural change (install_packed on a reload of other formats: layer 0's down_proj Q4_0 ->
    # Q8_0, a new module). The guard-free bytecode would run the old format's graph on it, so the
    # direct path must switch itself off and Dynamo's guards recompile: tokens still eager's.
    for core in (compiled, eager):
        mlp = core.model.model.layers[0].mlp
        weight = gguf_cpu.dequantize(mlp.down_proj.blocks, mlp.down_proj.ggml_type, mlp.down_proj.in_features)
        blocks = torch.from_numpy(np.ascontiguousarray(quantize(weight.numpy() * -2.0, Q.Q8_0)))
        mlp.down_proj = GgufLinear(blocks, int(Q.Q8_0), mlp.down_proj.in_features, None, mlp.down_proj.activations)
    assert compiled.forward.direct_invalidated and "down_proj" in compiled.forward.direct_invalidated
    steps, direct = compiled.forward.num_compiled_steps, compiled.forward.num_direct_steps
    natively = compiled.forward.num_native_steps
    swapped = _greedy(compiled)
    assert swapped != after
    assert swapped == _greedy(eager)
    assert compiled.forward.num_compiled_steps > steps and compiled.forward.num_direct_steps == direct
    assert compiled.forward.num_native_steps == natively  # native decode goes off with the direct path


def test_with_the_default_sizes_no_graph_is_compiled_where_native_decode_takes_every_step(checkpoint):
    """Native decode runs every decode step of the plain Llama family (float32 KV, no speculation, no
    more sequences than its kernels take), so with the default --compile-batch-sizes nothing is
    compiled: the engine starts without Inductor, and its greedy tokens are eager's. Sizes given on the
    command line still compile; an fp8 KV cache, speculation or a family native decode does not take
    keep the default sizes."""
    from trillium.actors.executor.compiled_decode import _native_takes_every_decode_step
    from trillium.models.loader import load_model

    from trillium.kernels import dense_cpu, panel_cpu

    if not native_ops.load() or os.environ.get("TRILLIUM_NATIVE_DECODE") == "0":
        pytest.skip(f"no native decode: {native_ops.unavailable_reason() or 'TRILLIUM_NATIVE_DECODE=0'}")
    path = checkpoint("llama")
    # as many sequences as native decode's float32 rows take (dense_cpu's: 64 on AVX2 and Intel's AVX-512,
    # 16 elsewhere); on a Zen 4 with the panel kernel the default 64 (its float32 rows go on to 256)
    config = EngineConfig.build(model=str(path), kv_cache_memory="4MiB", enforce_eager=False,
                                max_num_seqs=64 if panel_cpu.active() else dense_cpu.MAX_ROWS).resolve()
    assert config.compile_batch_sizes_defaulted and config.compile_batch_sizes  # the defaults, resolved
    assert attrs.evolve(config).resolve().compile_batch_sizes_defaulted  # a second resolve keeps it
    assert EngineConfig.from_bytes(config.to_bytes()).compile_batch_sizes_defaulted  # as actors get it
    native = ExecutorCore(config)
    assert isinstance(native.forward, CompiledDecode) and native.forward.compiled_sizes == ()
    assert native.forward.compile_s == {} and native.forward.native_decode is not None
    eager = ExecutorCore(_config(path, True))
    tokens = _greedy(native)
    assert tokens == _greedy(eager)
    assert native.forward.num_native_steps >= 7
    # with no graph, a step native decode refused would run eager unseen: 20 rows at once run natively
    many = {f"m{i}": [4 + i, 9, 13 + i] for i in range(20)}
    before = native.forward.num_native_steps
    assert _greedy(native, many) == _greedy(eager, many)
    assert native.forward.num_native_steps >= before + 7 and native.forward.num_compiled_steps == \
        native.forward.num_native_steps
    # A structural change (a buffer registered on a layer) turns native decode off for good, graphs or
    # not: its steps then run eager, as an engine without graphs runs what native decode refuses.
    native.model.model.layers[0].mlp.register_buffer("extra", torch.zeros(1))
    assert native.forward.direct_invalidated and "extra" in native.forward.direct_invalidated
    steps = native.forward.num_native_steps
    assert _greedy(native, {"again": PROMPTS["b"]})["again"][: MAX_TOKENS["b"]] == tokens["b"]
    assert native.forward.num_native_steps == steps
    given = EngineConfig.build(model=str(path), kv_cache_memory="4MiB", enforce_eager=False,
                               compile_batch_sizes=(1,)).resolve()
    assert not given.compile_batch_sizes_defaulted
    model = native.model
    assert _native_takes_every_decode_step(config, model)
    assert not _native_takes_every_decode_step(attrs.evolve(config, kv_cache_dtype="fp8_e4m3"), model)
    assert not _native_takes_every_decode_step(attrs.evolve(config, max_num_seqs=1000), model)
    spec = EngineConfig.build(model=str(path), kv_cache_memory="4MiB", enforce_eager=False,
                              speculative_config={"method": "ngram", "num_speculative_tokens": 3}).resolve()
    assert not _native_takes_every_decode_step(spec, model)
    gemma = load_model(checkpoint("gemma2"), dtype="float32", progress=False)[0]  # not the plain Llama family
    assert not _native_takes_every_decode_step(config, gemma)
