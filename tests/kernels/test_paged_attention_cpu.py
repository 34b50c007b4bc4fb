"""The CPU paged decode attention kernel (trillium/kernels/paged_attention_cpu.c) against the gather path.

Oracles: `reference.paged_attention` (gathers the blocks into a dense copy,
then SDPA) and the float64 per-head `dense_causal_attention`. Odd shapes:
head dims 8 / 40 / 80 / 17 / 64 / 128, GQA ratios 1 to 8, block sizes 1 / 5 / 16,
lengths that end mid-block, cross several blocks or fit in one, and batches
of mixed lengths; fp8 caches (e4m3fn, e5m2, with scales), sliding windows and
soft-capping as the reference has them; rows long enough to be split into
several 64-key chunks and merged (split-K), windows that start mid-chunk. Unowned slots (the tails of last
blocks, block-table padding, blocks behind a window) hold NaN: the kernel
never reads them, where the reference gather reads (and masks) the first two.
Mirrors vLLM's CPU decode kernel's shape: per sequence and KV head over the
block table in place, no gathered copy (vllm-project/vllm
csrc/cpu/attention.cpp `paged_attention_v1_impl`).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch

from support.paged_batches import dense_causal_attention, make_paged_batch
from trillium import kernels
from trillium.benchmarks.revisions import using
from trillium.kernels import AttentionMetadata, paged_attention_cpu, reference
from trillium.kernels.c_library import CLibrary
from trillium.kernels.fp8 import quantize_fp8

pytestmark = pytest.mark.skipif(not paged_attention_cpu.available(), reason="no C compiler for the kernel")

# (H, KH, D, block size, seq lens)
SHAPES = [
    (8, 4, 64, 16, [1, 17, 40, 33, 16]),
    (6, 1, 40, 5, [7, 23, 11]),
    (4, 4, 80, 1, [9, 3]),
    (16, 2, 17, 16, [100, 2, 31]),
    (8, 8, 8, 5, [5, 26]),
    # several 64-key chunks per row (split-K, merged): lengths at, just past and well past chunk ends
    (9, 3, 64, 16, [300, 64, 65, 129]),
    (6, 3, 40, 5, [200, 1, 128]),
    # the fixed-head-dim paths (D 64 / 128; AVX-512: keys in groups of 16, AVX2: of 8) within blocks of 5, 16 or 32
    (4, 2, 128, 5, [70, 3, 129]),
    (6, 2, 64, 32, [100, 17, 64, 1]),
    (4, 4, 64, 1, [20, 9, 1]),  # blocks of one key, no GQA sharing
]


def _batch(shape, seed=0, fill=float("nan")):
    heads, kv_heads, dim, block, lens = shape
    return make_paged_batch([1] * len(lens), lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                            block_size=block, seed=seed, fill=fill)  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}kh{s[1]}d{s[2]}bs{s[3]}")
def test_decode_matches_gather_path_and_dense(shape):
    batch = _batch(shape, seed=len(shape[4]))
    out = paged_attention_cpu.decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    torch.testing.assert_close(out.double(), dense_causal_attention(batch), atol=2e-5, rtol=1e-5)
    finite = _batch(shape, seed=len(shape[4]), fill=None)  # the reference reads unowned slots: finite
    args = (finite.q, finite.k_cache, finite.v_cache, finite.meta, finite.scale)
    torch.testing.assert_close(paged_attention_cpu.decode_attention(*args), reference.paged_attention(*args),
                               atol=2e-6, rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("window, softcap", [(4, None), (9, 3.0), (1, None), (None, 5.0), (200, None)])
def test_window_and_softcap_never_read_behind_the_window(window, softcap):
    batch = _batch(SHAPES[0], seed=2)
    table, block = batch.meta.block_tables, batch.k_cache.shape[1]
    for b, n in enumerate(batch.meta.seq_lens_list):  # blocks wholly behind the window: freed, poisoned
        for i in range(max(0, n - (window or n)) // block):
            batch.k_cache[table[b, i]] = batch.v_cache[table[b, i]] = float("nan")
    args = (batch.q * 3, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    out = paged_attention_cpu.decode_attention(*args, sliding_window=window, softcap=softcap)
    expected = dense_causal_attention(attrs.evolve(batch, q=batch.q * 3), sliding_window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window, softcap", [(70, None), (130, 4.0), (64, None)])
def test_windows_over_several_chunks(window, softcap):
    """Rows of several 64-key chunks with a window that starts inside one (or on a chunk's edge)."""
    batch = _batch(SHAPES[5], seed=5)
    args = (batch.q * 3, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    out = paged_attention_cpu.decode_attention(*args, sliding_window=window, softcap=softcap)
    expected = dense_causal_attention(attrs.evolve(batch, q=batch.q * 3), sliding_window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_cache_matches_gather_path(dtype):
    """fp8 values widened as the reference widens them, k_scale on the scores, v_scale on the output."""
    batch = _batch(SHAPES[1], seed=4, fill=0.0)
    k_scale, v_scale = torch.tensor(0.25), torch.tensor(0.5)
    k8, v8 = quantize_fp8(batch.k_cache, k_scale, dtype), quantize_fp8(batch.v_cache, v_scale, dtype)
    args = (batch.q, k8, v8, batch.meta, batch.scale, k_scale, v_scale)
    out = paged_attention_cpu.decode_attention(*args, sliding_window=10)
    torch.testing.assert_close(out, reference.paged_attention(*args, sliding_window=10), atol=2e-6, rtol=1e-5)


def test_dispatch_takes_the_kernel_for_decode_only(monkeypatch):
    """Pure decode on CPU goes to the kernel (NaN unowned slots stay unread); TRILLIUM_KERNELS=reference, a
    step with a prefill, or bfloat16 go to the gather path (which reads, and so returns, the NaN)."""
    batch = _batch(SHAPES[0])
    args = (batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert paged_attention_cpu.decode_supported(*args[:4])
    assert kernels.paged_attention(*args).isfinite().all()
    strided = torch.cat((batch.q, torch.zeros_like(batch.q)), dim=-1)[..., : batch.q.shape[-1]]
    torch.testing.assert_close(kernels.paged_attention(strided, *args[1:]), kernels.paged_attention(*args))
    assert not paged_attention_cpu.decode_supported(batch.q.bfloat16(), *args[1:4])
    monkeypatch.setenv("TRILLIUM_KERNELS", "reference")
    assert kernels.paged_attention(*args).isnan().any()
    monkeypatch.delenv("TRILLIUM_KERNELS")
    mixed = make_paged_batch([1, 4], [20, 9], num_heads=8, num_kv_heads=4, head_dim=64, block_size=16)
    assert not paged_attention_cpu.decode_supported(mixed.q, mixed.k_cache, mixed.v_cache, mixed.meta)


def test_a_large_batch_at_two_threads_gives_each_row_its_bits_alone():
    """48 rows of 100-400 keys (~250 64-key work items shared by the threads as they come free):
    every row matches the oracle and equals, bit for bit, its own one-row call at one thread."""
    lens = [100 + (37 * i) % 300 for i in range(48)]
    batch = make_paged_batch([1] * len(lens), lens, num_heads=8, num_kv_heads=4, head_dim=64, block_size=16, seed=9)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        out = paged_attention_cpu.decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
        torch.set_num_threads(1)
        tables = batch.meta.block_tables.tolist()
        for row in (0, 17, 47):
            one = AttentionMetadata.build([1], [lens[row]], [tables[row]], batch.k_cache.shape[1])
            alone = paged_attention_cpu.decode_attention(batch.q[row : row + 1], batch.k_cache, batch.v_cache, one,
                                                         batch.scale)
            assert torch.equal(alone[0], out[row])
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out.double(), dense_causal_attention(batch), atol=2e-5, rtol=1e-5)


def test_verify_rows_attend_as_their_decode_steps():
    """A speculative verify step (meta.verify_rows: each sequence's last token and drafts) takes the
    kernel: every row matches the gather path, and equals, bit for bit, the decode step at that
    row's position (what greedy identity with plain decoding rests on). Without the flag, or past
    MAX_VERIFY_ROWS rows, the step goes to the gather path."""
    qlens, lens = [5, 1, 3], [66, 17, 9]  # the first sequence's rows see 62 .. 66 keys: one chunk, then two
    batch = make_paged_batch(qlens, lens, num_heads=8, num_kv_heads=4, head_dim=64, block_size=16, seed=3)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert not paged_attention_cpu.decode_supported(*args[:4])
    meta = attrs.evolve(batch.meta, verify_rows=True, derived={})
    assert paged_attention_cpu.decode_supported(*args[:3], meta)
    out = kernels.paged_attention(batch.q, batch.k_cache, batch.v_cache, meta, batch.scale)
    torch.testing.assert_close(out, reference.paged_attention(*args), atol=2e-6, rtol=1e-5)
    tables, row = batch.meta.block_tables.tolist(), 0
    for b, (q_len, n) in enumerate(zip(qlens, lens)):
        for i in range(q_len):
            keys = n - q_len + i + 1
            one = AttentionMetadata.build([1], [keys], [tables[b]], batch.k_cache.shape[1])
            alone = paged_attention_cpu.decode_attention(batch.q[row : row + 1], *args[1:3], one, batch.scale)
            assert torch.equal(alone[0], out[row])
            row += 1
    long = make_paged_batch([paged_attention_cpu.MAX_VERIFY_ROWS + 1], [40], num_heads=8, num_kv_heads=4,
                            head_dim=64, block_size=16)
    assert not paged_attention_cpu.decode_supported(long.q, long.k_cache, long.v_cache,
                                                    attrs.evolve(long.meta, verify_rows=True))


@pytest.mark.parametrize("verify", [False, True], ids=["decode", "verify"])
def test_mixed_step_decode_rows_attend_as_their_decode_steps(verify):
    """A step holding decode rows beside prefill chunks (continuous batching) sends its decode rows (and,
    in a verify step, each sequence's few verify rows) through the kernel, bit for bit the decode step
    each stands for, and only the prefill chunks to the gather path: a request's greedy tokens do not
    depend on whether another request was prefilling beside it."""
    qlens, lens = ([3, 1, 20, 1, 9], [40, 17, 20, 66, 30]) if verify else ([1, 20, 1, 9], [17, 20, 66, 30])
    batch = make_paged_batch(qlens, lens, num_heads=8, num_kv_heads=4, head_dim=64, block_size=16, seed=5,
                             fill=None)
    meta = attrs.evolve(batch.meta, verify_rows=verify, derived={})
    args = (batch.q, batch.k_cache, batch.v_cache, meta, batch.scale)
    assert not paged_attention_cpu.decode_supported(*args[:4])
    out = kernels.paged_attention(*args)
    torch.testing.assert_close(out, reference.paged_attention(*args), atol=2e-6, rtol=1e-5)
    tables, row, limit = batch.meta.block_tables.tolist(), 0, paged_attention_cpu.MAX_VERIFY_ROWS if verify else 1
    for b, (q_len, n) in enumerate(zip(qlens, lens)):
        for i in range(q_len):
            if q_len <= limit:
                keys = n - q_len + i + 1
                one = AttentionMetadata.build([1], [keys], [tables[b]], batch.k_cache.shape[1])
                alone = paged_attention_cpu.decode_attention(batch.q[row : row + 1], *args[1:3], one, batch.scale)
                assert torch.equal(alone[0], out[row]), (b, i)
            row += 1
    kinds = paged_attention_cpu.mixed_split(meta)
    assert kinds is not None and kinds[1].num_seqs == sum(n <= limit for n in qlens)
    decode_only = make_paged_batch([1, 1], [5, 9], num_heads=8, num_kv_heads=4, head_dim=64, block_size=16)
    assert paged_attention_cpu.mixed_split(decode_only.meta) is None  # not mixed: the kernel takes it whole


_CPU_FLAGS = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
_BUILDS = {"plain C": ("-O3",), "AVX2": ("-O3", "-mavx2", "-mfma")}


@pytest.mark.parametrize("build", [b for b in _BUILDS if b == "plain C" or " avx2 " in _CPU_FLAGS])
def test_builds_without_avx512_match_the_oracle_and_each_row_alone(build):
    """The same source built for a CPU without AVX-512 (AVX2: attend_chunk_fixed8 at head dims 64 / 128) or
    without AVX2 (the plain loops), as a machine of that kind builds it: every shape matches the float64
    oracle, and a row's output is the same bits in a batch and alone (verify rows rest on it), whichever
    build this machine's own is."""
    lib = CLibrary(paged_attention_cpu._SOURCE, f"the CPU paged decode attention kernel ({build})",
                   paged_attention_cpu._declare,
                   flags=(*_BUILDS[build], "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11"))
    assert lib.get() is not None
    with using(paged_attention_cpu, lib):
        for shape in SHAPES:
            batch = _batch(shape, seed=len(shape[4]))
            out = paged_attention_cpu.decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
            torch.testing.assert_close(out.double(), dense_causal_attention(batch), atol=2e-5, rtol=1e-5)
            tables, lens = batch.meta.block_tables.tolist(), shape[4]
            row = len(lens) - 1
            one = AttentionMetadata.build([1], [lens[row]], [tables[row]], batch.k_cache.shape[1])
            alone = paged_attention_cpu.decode_attention(batch.q[row : row + 1], batch.k_cache, batch.v_cache, one,
                                                         batch.scale)
            assert torch.equal(alone[0], out[row]), shape
