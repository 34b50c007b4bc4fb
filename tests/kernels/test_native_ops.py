"""The C++ ops compiled decode calls (trillium/kernels/native_ops.cpp) against the Python ops they stand for.

Each native op must give the Python op's bits (same C kernels behind both): the packed GGUF linear
for every format and both activation modes, the float32 few-rows linear, and the graph attention
for a decode step and a speculative verify step -- all with padding rows (the live-row hint) and
the attention's cache writes compared slot for slot. A step the native attention does not take
(an fp8 cache) must run the Python op through the dispatcher, and bad inputs must raise, not crash.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from trillium.kernels import AttentionMetadata, gguf_cpu, native_ops, padded_rows
from trillium.models import gguf_kquant_encode, llama, packed_linear  # noqa: F401 (register the Python ops)
from trillium.models.graph_attention import GraphAttentionContext, graph_kv_slots
from trillium.models.kv_cache import KvCache

pytestmark = pytest.mark.skipif(not native_ops.load(), reason=f"no native ops: {native_ops.unavailable_reason()}")

FORMATS = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K]


def _blocks(n: int, k: int, qtype: Q, seed: int) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    encode = gguf_kquant_encode.quantize if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else quantize
    return torch.from_numpy(np.ascontiguousarray(encode(w, qtype)))


# int8 activations for the formats with an int8 kernel (GgufLinear runs the K-quants float32)
CASES = [(q, a) for q in FORMATS for a in (gguf_cpu.FLOAT32, gguf_cpu.INT8)
         if a == gguf_cpu.FLOAT32 or int(q) in gguf_cpu.INT8_TYPES]


@pytest.mark.parametrize("qtype, activations", CASES, ids=lambda c: getattr(c, "name", c))
def test_gguf_linear_equals_the_python_op(qtype: Q, activations: str) -> None:
    k, n = 512, 96
    blocks = _blocks(n, k, qtype, seed=int(qtype))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    for rows in (1, 3, 8):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        for b in (None, bias):
            args = (x, blocks, int(qtype), k, b, activations)
            native = (*args[:-1], activations == gguf_cpu.INT8)  # the C++ op takes the choice as a bool
            want = torch.ops.trillium.gguf_linear(*args)
            assert torch.equal(torch.ops.trillium_native.gguf_linear(*native), want)
            for live in range(1, rows):  # padding rows: the live ones computed, the rest zero (+ bias)
                with padded_rows.live_rows(live):
                    got, python = torch.ops.trillium_native.gguf_linear(*native), torch.ops.trillium.gguf_linear(*args)
                assert torch.equal(got[:live], want[:live]) and torch.equal(got[:live], python[:live])
                assert torch.equal(got[live:], torch.zeros(rows - live, n) if b is None else b.expand(rows - live, n))


def test_cpu_linear_equals_the_python_op() -> None:
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, 200, generator=gen) * 0.1, torch.randn(300, generator=gen)
    for rows in (1, 5, 16):
        wide = torch.randn(rows, 232, generator=gen)
        x = wide[:, 16:216]  # rows 232 floats apart
        for bias in (None, b):
            want = torch.ops.trillium.cpu_linear(x, w, bias)
            assert torch.equal(torch.ops.trillium_native.cpu_linear(x, w, bias), want)
            if rows > 1:
                with padded_rows.live_rows(rows - 1):
                    got = torch.ops.trillium_native.cpu_linear(x, w, bias)
                assert torch.equal(got[: rows - 1], want[: rows - 1]) and not got[rows - 1].any()


def test_linears_refuse_what_they_do_not_take() -> None:
    k, n = 64, 32
    blocks = _blocks(n, k, Q.Q4_0, seed=3)
    x = torch.randn(2, k)
    with pytest.raises(RuntimeError, match="packed weights must be"):
        torch.ops.trillium_native.gguf_linear(x, blocks[:, :-1].contiguous(), int(Q.Q4_0), k, None, True)
    with pytest.raises(RuntimeError, match="no int8-activation kernel"):
        torch.ops.trillium_native.gguf_linear(x, blocks, int(Q.Q4_K), k, None, True)  # K-quants: float32 only
    with pytest.raises(RuntimeError, match="no packed CPU kernel"):
        torch.ops.trillium_native.gguf_linear(x, blocks, 99, k, None, False)
    with pytest.raises(RuntimeError, match="x must be float32"):
        torch.ops.trillium_native.gguf_linear(x.double(), blocks, int(Q.Q4_0), k, None, False)
    with pytest.raises(RuntimeError, match="up to 64 live rows"):
        torch.ops.trillium_native.gguf_linear(torch.randn(65, k), blocks, int(Q.Q4_0), k, None, True)
    with pytest.raises(RuntimeError, match="up to 64 live rows"):
        torch.ops.trillium_native.cpu_linear(torch.randn(65, k), torch.randn(n, k), None)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        torch.ops.trillium_native.cpu_linear(x, torch.randn(k, n).t(), None)


def _step(num_blocks: int = 12, dtype: torch.dtype = torch.float32):
    """2 layers' caches (block 4, KH 2, D 16; float32 ones hold earlier tokens) and a context with a native Step."""
    gen = torch.Generator().manual_seed(7)
    caches = []
    for _ in range(2):
        if dtype == torch.float32:
            k_cache, v_cache = (torch.randn(num_blocks, 4, 2, 16, generator=gen) for _ in range(2))
            caches.append(KvCache(k_cache, v_cache))
        else:  # fp8, uncalibrated as allocate_kv_caches makes it
            k_cache, v_cache = (torch.zeros(num_blocks, 4, 2, 16, dtype=dtype) for _ in range(2))
            caches.append(KvCache(k_cache, v_cache, torch.ones(()), torch.ones(()), calibrated=False))
    context = GraphAttentionContext()
    context.native_step = native_ops.Step()
    return caches, context


def _clone(caches):
    return [KvCache(c.k_cache.clone(), c.v_cache.clone(), c.k_scale, c.v_scale, c.calibrated) for c in caches]


@pytest.mark.parametrize("verify", [False, True], ids=["decode", "verify"])
def test_graph_attention_equals_the_python_op_and_writes_the_same_slots(verify: bool) -> None:
    caches, context = _step()
    if verify:  # one sequence: its last token and 2 drafts (3 rows), and a second one decoding
        meta = AttentionMetadata.build([3, 1], [9, 6], [[0, 1, 2], [3, 4]], 4, verify_rows=True)
    else:
        meta = AttentionMetadata.build([1, 1, 1], [9, 6, 13], [[0, 1, 2], [3, 4], [5, 6, 7, 8]], 4)
    rows = meta.num_tokens + 1  # a padding row, as a graph of the next bucket has
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(rows, h, 16, generator=gen) for h in (4, 2, 2))
    python_caches = _clone(caches)
    slots = graph_kv_slots(context, 2)
    for layer in range(2):
        context.kv_caches, context.meta = python_caches, meta
        want = torch.ops.trillium.graph_attention(q, k, v, context.context_id, layer, 0.25, None, None)
        context.kv_caches = caches
        assert context.native_step.set(caches, meta)
        got = slots[layer].attend(q, k, v, meta, 0.25, sliding_window=None, softcap=None)
        context.native_step.clear()
        assert torch.equal(got, want) and not got[-1].any()
        assert torch.equal(caches[layer].k_cache, python_caches[layer].k_cache)
        assert torch.equal(caches[layer].v_cache, python_caches[layer].v_cache)
    # sliding window and soft-capping reach the kernel too
    context.kv_caches, context.meta = python_caches, meta
    want = torch.ops.trillium.graph_attention(q, k, v, context.context_id, 0, 0.25, 3, 5.0)
    assert context.native_step.set(caches, meta)
    assert torch.equal(slots[0].attend(q, k, v, meta, 0.25, sliding_window=3, softcap=5.0), want)
    context.native_step.clear()


def test_graph_attention_runs_the_python_op_for_a_step_it_does_not_take() -> None:
    """An fp8 cache: Step.set says no, and the native op calls trillium::graph_attention (the
    calibration and the fp8 writes are the Python path's); after clear() the same holds."""
    caches, context = _step(dtype=torch.float8_e4m3fn)
    meta = AttentionMetadata.build([1, 1], [5, 2], [[0, 1], [2]], 4)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 16, generator=gen) for h in (4, 2, 2))
    python_caches = _clone(caches)
    context.kv_caches, context.meta = python_caches, meta
    want = torch.ops.trillium.graph_attention(q, k, v, context.context_id, 0, 0.25, None, None)
    assert not context.native_step.set(caches, meta)
    context.kv_caches = caches
    got = graph_kv_slots(context, 2)[0].attend(q, k, v, meta, 0.25, sliding_window=None, softcap=None)
    assert torch.equal(got, want)
    assert torch.equal(caches[0].k_cache.view(torch.uint8), python_caches[0].k_cache.view(torch.uint8))
    context.meta = None  # warm-up: the Python op's zeros
    context.native_step.clear()
    assert not graph_kv_slots(context, 2)[1].attend(q, k, v, meta, 0.25, sliding_window=None, softcap=None).any()


def test_a_graph_names_its_step_by_a_small_id_the_same_in_every_process() -> None:
    """The step a compiled graph passes graph_attention is a constant of that graph, and Inductor's disk
    cache keys graphs by their constants: it must be the lowest free id (the same steps made in the same
    order get the same ids in every process), not the Step's address (then every start missed the
    cache and compiled again)."""
    import gc

    gc.collect()  # Steps of earlier tests freed first
    first, second = native_ops.Step(), native_ops.Step()
    ids = (first.id, second.id)
    assert 0 < ids[0] < ids[1] < 256 and ids[1] == ids[0] + 1
    assert ids[0] != first.handle and ids[1] != second.handle  # not the addresses
    context = GraphAttentionContext()
    context.native_step = second
    assert {slot.native_step for slot in graph_kv_slots(context, 3)} == {ids[1]}
    del first
    gc.collect()
    assert native_ops.Step().id == ids[0]  # a freed id is the next one given


def test_graph_attention_refuses_a_slot_outside_the_cache() -> None:
    caches, context = _step(num_blocks=2)
    meta = AttentionMetadata.build([1], [3], [[1]], 4)
    meta.slot_mapping[0] = 8  # past the cache's 2 x 4 slots
    assert context.native_step.set(caches, meta)
    q, k, v = torch.randn(1, 4, 16), torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    with pytest.raises(RuntimeError, match="slot 8 outside a cache of 8 slots"):
        graph_kv_slots(context, 2)[0].attend(q, k, v, meta, 0.25, sliding_window=None, softcap=None)
    context.native_step.clear()


@pytest.mark.parametrize("rows", [1, 3, 8, 37])
def test_row_wise_ops_give_eagers_bits(rows: int) -> None:
    """rms_norm, silu_and_mul and rope, native and their Python twins (dispatch.py), give the bits
    eager gets (dispatch's CPU path: rowwise_cpu.c; rope also kernels/reference.py's exactly) -- what a
    compiled graph computes is what eager computes -- on the strided views a layer hands them (q / k of
    one fused projection, a norm's input at an offset) and odd widths (a tail past the vector loop)."""
    from trillium.kernels import dispatch, reference

    gen = torch.Generator().manual_seed(rows)
    heads, kv_heads, head_dim, hidden = 5, 2, 66, 203
    wide = torch.randn(rows, 2 * hidden + 1, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    for x in (torch.randn(rows, hidden, generator=gen) * 3, wide[:, 1 : hidden + 1]):  # contiguous, strided
        want = dispatch._cpu_rms_norm(x, weight, 1e-5)
        for op in (torch.ops.trillium_native.rms_norm, torch.ops.trillium.rms_norm):
            assert torch.equal(op(x, weight, 1e-5), want)
    gate_up = torch.randn(rows, 2 * 170, generator=gen) * 4
    want = dispatch._cpu_silu_and_mul(gate_up)
    for op in (torch.ops.trillium_native.silu_and_mul, torch.ops.trillium.silu_and_mul):
        got = op(gate_up)
        assert got.is_contiguous() and torch.equal(got, want)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)  # rows strided, as Attention.forward's views
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    angles = torch.rand(4096, head_dim // 2, generator=gen) * 100
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    want_q, want_k = reference.rotary_embedding(positions, q, k, table)
    for op in (torch.ops.trillium_native.rotary_embedding, torch.ops.trillium.rotary_embedding):
        got_q, got_k = op(positions, q, k, table)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
        assert got_q.is_contiguous() and got_k.is_contiguous()


def test_row_wise_ops_run_the_reference_for_what_the_c_kernel_does_not_take() -> None:
    """Not float32, or a last dimension with a stride: the twin's reference, as eager; a position
    outside the rope table: the reference's IndexError, not a read past the table."""
    from trillium.kernels import reference

    x, weight = torch.randn(3, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    assert torch.equal(torch.ops.trillium_native.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    gate_up = torch.randn(6, 3).t()  # [3, 6], last dimension strided
    assert torch.equal(torch.ops.trillium_native.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
    table, q, k = torch.randn(16, 8), torch.randn(2, 3, 8), torch.randn(2, 1, 8)
    with pytest.raises(IndexError):
        torch.ops.trillium_native.rotary_embedding(torch.tensor([3, 16]), q, k, table)
    with pytest.raises(IndexError):
        torch.ops.trillium_native.rotary_embedding(torch.tensor([-1, 2]), q, k, table)
