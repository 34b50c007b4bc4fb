"""Native decode (trillium/models/native_decode.py, trillium_native_decode in kernels/native_ops.cpp)
against the eager forward, bit for bit, on the variants it takes -- no compiling: it needs only the
C++ ops library.

Each model gets a prefill of several sequences (eager), then decode steps of 1 row, a few rows and
the most rows native decode takes, each computed natively and eagerly on the same cache: the hidden
states must be the same bits, and so must the keys and values each wrote to its slots. Variants:
plain Llama; Qwen2 (a QKV bias); Qwen3 (q / k norms); Mistral with a sliding window shorter than the context; tied
embeddings; a GGUF file of int8-activation formats (Q8_0 / Q4_0 / Q4_1, 64 rows), and a Q4_K_M-style
one (K-quants, float32 activations: at most 32 rows, a float QKV in layer 0 beside packed linears).
And what it refuses: families it does not compute (Gemma), a weight swapped for another shape.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from trillium.kernels import AttentionMetadata, dense_cpu, gguf_cpu, native_ops, onednn_packed, panel_cpu
from trillium.kernels.metadata import DecodeRun
from trillium.models.gguf_writer import write_gguf
from trillium.models.loader import load_model
from trillium.models import native_decode
from trillium.models.native_decode import NativeDecode

pytestmark = pytest.mark.skipif(not native_ops.load(), reason=f"no native ops: {native_ops.unavailable_reason()}")

BLOCK = 16


def _int8_mix(name: str) -> Q:  # as test_compiled_decode: Q8_0 embedding / head, Q4_0 down, Q4_1 the rest
    return Q.Q8_0 if name.startswith(("token_embd", "output.")) else Q.Q4_0 if ".ffn_down." in name else Q.Q4_1


def _kquant_mix(name: str) -> Q:  # tests/models/test_models_gguf_packed.py q4_k_m_mix
    if name.startswith("token_embd") or name in ("blk.0.ffn_down.weight", "blk.0.attn_v.weight"):
        return Q.Q6_K
    return Q.Q5_K if name.startswith(("blk.1.ffn_gate", "blk.1.ffn_up")) else Q.Q4_K


def _model(checkpoint, tmp_path, case: str):
    if case in ("llama", "qwen2", "qwen3", "llama-tied"):
        return load_model(checkpoint(case), dtype="float32", progress=False)[0]
    if case == "mistral-sliding":
        return load_model(checkpoint(case, sliding_window=8), dtype="float32", progress=False)[0]
    if case == "gguf-int8":
        return load_model(write_gguf(checkpoint("llama"), tmp_path / "m.gguf", quantize=_int8_mix), progress=False)[0]
    hf = checkpoint("llama-tied", hidden_size=256, intermediate_size=256, head_dim=64)  # K-quants: K = 256
    return load_model(write_gguf(hf, tmp_path / "m.gguf", quantize=_kquant_mix), progress=False)[0]


def _decode_steps(model, native: NativeDecode, rows: int, seed: int) -> None:
    """Prefill `rows` sequences of different lengths, then two decode steps of all of them, each natively
    and eagerly on the same cache: same hidden bits, same keys and values in the step's slots."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    lens = [5 + (7 * i) % 29 for i in range(rows)]  # 5..33 tokens: past mistral-sliding's window of 8
    per_seq = -(-(max(lens) + 2) // BLOCK)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(rows)]
    caches = model.allocate_kv_caches(1 + rows * per_seq, BLOCK)
    step = native_ops.Step()
    with torch.inference_mode():
        ids = torch.randint(0, vocab, (sum(lens),), generator=generator)
        positions = torch.cat([torch.arange(n) for n in lens])
        model(ids, positions, caches, AttentionMetadata.build(lens, lens, tables, BLOCK))
        for extra in range(2):
            meta = AttentionMetadata.build([1] * rows, [n + 1 + extra for n in lens], tables, BLOCK)
            step_ids = torch.randint(0, vocab, (rows,), generator=generator)
            step_pos = torch.tensor([n + extra for n in lens])
            eager = model(step_ids, step_pos, caches, meta)
            slots = meta.slot_mapping
            written = [(c.k_cache.flatten(0, 1)[slots].clone(), c.v_cache.flatten(0, 1)[slots].clone()) for c in caches]
            for cache in caches:  # the native forward must write them again
                cache.k_cache.flatten(0, 1)[slots] = 0.0
                cache.v_cache.flatten(0, 1)[slots] = 0.0
            assert step.set(caches, meta)
            try:
                got = native(step_ids, step_pos, step)
            finally:
                step.clear()
            assert got is not None, rows
            assert torch.equal(got, eager), (rows, (got - eager).abs().max())
            for cache, (k, v) in zip(caches, written):
                assert torch.equal(cache.k_cache.flatten(0, 1)[slots], k)
                assert torch.equal(cache.v_cache.flatten(0, 1)[slots], v)


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "mistral-sliding", "llama-tied", "gguf-int8",
                                  "gguf-kquants"])
def test_native_decode_has_the_eager_forwards_bits(checkpoint, tmp_path, case: str) -> None:
    if case.startswith("gguf") and not gguf_cpu.available():
        pytest.skip(f"no packed kernel: {gguf_cpu.unavailable_reason()}")
    model = _model(checkpoint, tmp_path, case)
    native, why_not = NativeDecode.build(model)
    assert native is not None, why_not
    if case == "qwen2":
        assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    if case == "qwen3":
        assert model.model.layers[0].self_attn.q_norm is not None  # per-head q / k norms before rope
    if case == "mistral-sliding":
        assert all(layer.self_attn.sliding_window == 8 for layer in model.model.layers)
    # the rows every linear's kernel takes: float32 ones dense_cpu's (64 on AVX2), or native_decode.MAX_ROWS
    # where panel_cpu runs those past dense_cpu's (a Zen 4); the packed kernel's 64 with int8
    # activations, 32 with float32 ones (the K-quants)
    float_rows = native_decode.MAX_ROWS if panel_cpu.active() else dense_cpu.MAX_ROWS
    expected_rows = {"gguf-int8": 64, "gguf-kquants": min(float_rows, 32)}  # kquants: a float32 QKV in layer 0
    assert native.max_rows == expected_rows.get(case, float_rows)
    for seed, rows in enumerate(sorted({1, 3, min(dense_cpu.MAX_ROWS + 1, native.max_rows), min(40, native.max_rows),
                                        native.max_rows})):
        _decode_steps(model, native, rows, seed)


@pytest.mark.skipif(not panel_cpu.active(), reason="float32 rows past dense_cpu's run on the panels only here")
def test_native_decode_past_dense_rows_reads_the_updated_weights_panels(checkpoint) -> None:
    """Past dense_cpu.MAX_ROWS rows the layers' float32 linears run on their panel-packed copies
    (onednn_packed.copy_of): after a live update (load_weights: in place, forget()) and a
    `param.data` swap the native rows are still eager's -- the copies made again, not the old ones."""
    model = load_model(checkpoint("llama"), dtype="float32", progress=False)[0]
    native, _ = NativeDecode.build(model)
    rows = dense_cpu.MAX_ROWS + 4
    _decode_steps(model, native, rows, seed=5)
    params = dict(model.named_parameters())
    with torch.inference_mode():
        before = onednn_packed.copy_of(params["model.layers.0.mlp.down_proj.weight"], "panel", panel_cpu.pack).clone()
        down = "model.layers.0.mlp.down_proj.weight"
        model.load_weights([(down, params[down] * -3)])
        gate_up = params["model.layers.1.mlp.gate_up_proj.weight"]
        gate_up.data = gate_up.data + torch.randn(gate_up.shape, generator=torch.Generator().manual_seed(1)) * 0.5
    _decode_steps(model, native, rows, seed=6)
    after = onednn_packed.copy_of(params["model.layers.0.mlp.down_proj.weight"], "panel", panel_cpu.pack)
    assert torch.equal(after, before * -3)  # the updated weight's panels (packing is a copy)
    # and native decode read the copies made after the update (not the freed ones' addresses)
    assert [native._panel_ptrs[i] for i, _ in native._float_linears] == [
        onednn_packed.copy_of(m.weight, "panel", panel_cpu.pack).data_ptr() for _, m in native._float_linears]


def test_native_decode_refuses_rows_a_kernel_does_not_take_before_writing(checkpoint, tmp_path) -> None:
    """trillium_native_decode / _greedy check every linear's rows (and the greedy head's) before
    writing anything (native_ops.cpp takes_rows): past the packed kernel's 64 rows, or past
    dense_cpu's rows with no panel copy handed over, they refuse (-1: None here) and the cache
    holds nothing of the step -- Python's max_rows is lifted here to reach them."""
    cases = [("gguf-int8", None)]
    if panel_cpu.active():
        cases.append(("llama", "no panels"))
    for case, how in cases:
        if case.startswith("gguf") and not gguf_cpu.available():
            continue
        model = _model(checkpoint, tmp_path, case)
        native, _ = NativeDecode.build(model)
        native.max_rows = native.greedy_rows = native_decode.MAX_ROWS  # past what its kernels take
        if how == "no panels":
            native._panels = lambda n, head=False: True  # the pointers stay NULL
        rows = 65 if how is None else dense_cpu.MAX_ROWS + 1
        caches = model.allocate_kv_caches(1 + rows, BLOCK)
        tables = [[1 + i] for i in range(rows)]
        step = native_ops.Step()
        with torch.inference_mode():
            meta = AttentionMetadata.build([1] * rows, [3] * rows, tables, BLOCK)
            assert step.set(caches, meta)
            try:
                assert native(torch.full((rows,), 5), torch.full((rows,), 2), step) is None, case
            finally:
                step.clear()
            run = DecodeRun.build([3] * rows, tables, BLOCK, 2)
            assert step.set_decode_run(caches, run)
            try:
                assert native.greedy([5] * rows, run, step, [frozenset()] * rows) is None, case
            finally:
                step.clear()
        assert all(not c.k_cache.any() and not c.v_cache.any() for c in caches), case


def test_native_decode_refuses_other_families_and_reshaped_weights(checkpoint) -> None:
    gemma = load_model(checkpoint("gemma2"), dtype="float32", progress=False)[0]
    native, why_not = NativeDecode.build(gemma)
    assert native is None and "not the plain Llama family" in why_not
    model = load_model(checkpoint("llama"), dtype="float32", progress=False)[0]
    native, _ = NativeDecode.build(model)
    caches = model.allocate_kv_caches(4, BLOCK)
    meta = AttentionMetadata.build([1], [3], [[1]], BLOCK)
    step = native_ops.Step()
    weight = model.model.layers[1].mlp.down_proj.weight
    with torch.inference_mode():
        for swap, taken in ((weight.data[:, :-1].contiguous(), False), (weight.data.clone(), True)):
            weight.data = swap  # another shape: the C++ loop would read past it, so it is refused
            assert step.set(caches, meta)
            try:
                assert (native(torch.tensor([7]), torch.tensor([2]), step) is not None) == taken
            finally:
                step.clear()


@pytest.mark.parametrize("rows", [3, 20])
@pytest.mark.parametrize("case", ["llama", "qwen2", "llama-tied", "gguf-int8", "gguf-kquants"])
def test_native_greedy_run_is_the_eager_forwards_and_argmax(checkpoint, tmp_path, case: str, rows: int) -> None:
    """NativeDecode.greedy (trillium_native_greedy): K decode forwards, each fed the argmax of the one
    before, are the eager forward + compute_logits + torch's argmax, bit for bit (logits, tokens and
    the keys and values written), on an untied head, a tied one, a biased QKV and packed heads (int8
    activations; the K-quants' float32 ones beside a float32 QKV); a row's stop id ends the run after
    the forward that sampled it. 20 rows: past dense_cpu's 16 on a Zen 4, the float32 layers and head
    on their panels (the packed models: their kernels' most rows, 20 or fewer)."""
    if case.startswith("gguf") and not gguf_cpu.available():
        pytest.skip(f"no packed kernel: {gguf_cpu.unavailable_reason()}")
    model = _model(checkpoint, tmp_path, case)
    native, why_not = NativeDecode.build(model)
    assert native is not None and not native.greedy_refused, (why_not, native and native.greedy_refused)
    if case == "gguf-int8":
        assert type(model.lm_head).__name__ == "GgufLinear"
    rows, steps = min(rows, native.greedy_rows), 5
    lens = [6, 19, 11, *(4 + (7 * i) % 23 for i in range(rows - 3))][:rows]
    per_seq = -(-(max(lens) + steps) // BLOCK)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(rows)]
    generator = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (sum(lens),), generator=generator)
        caches = model.allocate_kv_caches(1 + rows * per_seq, BLOCK)
        prefill = AttentionMetadata.build(lens, lens, tables, BLOCK)
        model(prompt, torch.cat([torch.arange(n) for n in lens]), caches, prefill)
        first = torch.randint(0, vocab, (rows,), generator=generator)
        saved = [(c.k_cache.clone(), c.v_cache.clone()) for c in caches]
        # the reference: eager forwards, the LM head as the executor calls it, torch's argmax
        ids, expected_tokens, expected_logits = first, [], []
        for j in range(steps):
            meta = AttentionMetadata.build([1] * rows, [n + 1 + j for n in lens], tables, BLOCK)
            logits = model.compute_logits(model(ids, torch.tensor([n + j for n in lens]), caches, meta))
            ids = logits.argmax(dim=-1)
            expected_tokens.append(ids.tolist())
            expected_logits.append(logits)
        expected_caches = [(c.k_cache.clone(), c.v_cache.clone()) for c in caches]
        for stop_at in (None, 2):  # a stop id row 1 samples at forward 2 (0-based)
            for cache, (k, v) in zip(caches, saved):
                cache.k_cache.copy_(k)
                cache.v_cache.copy_(v)
            run = DecodeRun.build([n + 1 for n in lens], tables, BLOCK, steps)
            stop_ids = [frozenset(), frozenset() if stop_at is None else {expected_tokens[stop_at][1]},
                        *[frozenset()] * (rows - 2)]
            got_logits = torch.full((steps, rows, model.lm_head_weight.shape[0] if model.lm_head is None
                                     else native._head.shape[0]), float("nan"))
            step = native_ops.Step()
            assert step.set_decode_run(caches, run)
            try:
                tokens = native.greedy(first.tolist(), run, step, stop_ids, logits=got_logits)
            finally:
                step.clear()
            ran = steps if stop_at is None else min(j for j in range(steps)
                                                    if expected_tokens[j][1] in stop_ids[1]) + 1
            assert tokens is not None and tokens.tolist() == expected_tokens[:ran]
            assert torch.equal(got_logits[:ran], torch.stack(expected_logits[:ran]))
            if stop_at is None:
                for cache, (k, v) in zip(caches, expected_caches):
                    assert torch.equal(cache.k_cache, k) and torch.equal(cache.v_cache, v)


def test_native_greedy_run_refuses_what_it_cannot_take(checkpoint) -> None:
    """Nothing written where the greedy run refuses: more rows than its kernels take, a slot past
    the cache, an LM head of more rows than the embedding has ids."""
    model = load_model(checkpoint("llama"), dtype="float32", progress=False)[0]
    native, _ = NativeDecode.build(model)
    caches = model.allocate_kv_caches(4, BLOCK)
    with torch.inference_mode():
        for tables, lens in (([[1]], [3]), ([[9]], [3])):  # block 9: past a cache of 4 blocks
            run = DecodeRun.build(lens, tables, BLOCK, 2)
            step = native_ops.Step()
            assert step.set_decode_run(caches, run)
            try:
                rows = native.greedy([7], run, step, [frozenset()]) if tables == [[9]] else native.greedy(
                    [7] * (native.max_rows + 1), run, step, [frozenset()] * (native.max_rows + 1))
            finally:
                step.clear()
            assert rows is None
            assert all(not c.k_cache.any() and not c.v_cache.any() for c in caches)
    model.lm_head.weight.data = torch.zeros(model.config.vocab_size + 1, model.config.hidden_size)
    assert "rows beside an embedding" in NativeDecode.build(model)[0].greedy_refused
