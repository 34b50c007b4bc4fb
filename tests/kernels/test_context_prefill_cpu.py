"""The CPU prefill attention kernel over the paged cache (paged_attention_cpu.c
`trillium_paged_prefill_attention`): a prompt's chunk after a context, as reference._attend_prefill
takes it for float32 on the CPU.

Oracles: the float64 per-head `dense_causal_attention` (support/paged_batches.py) and the gather +
SDPA path that `reference.paged_attention` takes under TRILLIUM_KERNELS=reference (what every later
chunk ran before). Odd shapes: contexts of 0 to 1000 keys ending mid-block, chunks of 1 to 300 rows
around the kernel's 16-row query blocks and 64-key blocks, block sizes 1 / 5 / 16 / 32 in shuffled
tables, GQA groups 1 to 16, head dims 16 / 32 / 64 / 128 / 256; unowned slots hold NaN (never read).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.paged_batches import dense_causal_attention, make_paged_batch
from trillium.benchmarks.revisions import using
from trillium.kernels import paged_attention_cpu, reference
from trillium.kernels.c_library import CLibrary

pytestmark = pytest.mark.skipif(not paged_attention_cpu.available(), reason="no C compiler for the kernel")

CASES = [  # (context, chunk rows, H, KH, D, block size)
    (0, 1, 8, 4, 64, 16),
    (0, 37, 8, 4, 64, 16),
    (5, 1, 8, 4, 64, 16),
    (17, 16, 8, 4, 64, 5),
    (64, 64, 4, 4, 64, 16),
    (100, 300, 8, 4, 64, 16),
    (1000, 200, 8, 2, 64, 32),
    (33, 65, 9, 3, 32, 1),
    (250, 129, 8, 1, 128, 16),
    (7, 20, 16, 2, 16, 16),
    (9, 30, 16, 1, 32, 16),
    (3, 20, 4, 2, 256, 8),
]


def _batch(case, seed: int = 0):
    ctx, rows, h, kh, d, bs = case
    return make_paged_batch([rows], [ctx + rows], num_heads=h, num_kv_heads=kh, head_dim=d, block_size=bs,
                            seed=seed, fill=float("nan"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_the_kernel_matches_causal_attention_in_float64(case):
    batch = _batch(case, seed=sum(case))
    table = batch.meta.block_tables[0]
    assert paged_attention_cpu.context_prefill_supported(batch.q, batch.k_cache, batch.v_cache, table)
    out = paged_attention_cpu.context_prefill_attention(batch.q, batch.k_cache, batch.v_cache, table, case[0],
                                                        batch.scale)
    torch.testing.assert_close(out.double(), dense_causal_attention(batch), atol=2e-6, rtol=1e-5)


def test_strided_query_rows_as_the_qkv_projection_hands_them_in():
    batch = _batch((40, 50, 8, 4, 64, 16))
    qkv = torch.randn(50, 16 * 64)
    qkv[:, : 8 * 64] = batch.q.reshape(50, -1)
    q = qkv[:, : 8 * 64].view(50, 8, 64)  # rows 1024 floats apart
    table = batch.meta.block_tables[0]
    out = paged_attention_cpu.context_prefill_attention(q, batch.k_cache, batch.v_cache, table, 40, batch.scale)
    torch.testing.assert_close(out.double(), dense_causal_attention(batch), atol=2e-6, rtol=1e-5)


def test_a_mixed_step_through_the_reference_gives_the_gather_paths_result(monkeypatch):
    """Two later chunks, a fresh prompt and decode rows in one step: reference.paged_attention (the
    kernel for the chunks) against itself under TRILLIUM_KERNELS=reference (gather + SDPA) and the oracle."""
    batch = make_paged_batch([30, 1, 100, 1, 12], [200, 77, 100, 5, 1000], num_heads=8, num_kv_heads=4,
                             head_dim=64, block_size=16, seed=5)
    calls = []
    kernel_fn = paged_attention_cpu.context_prefill_attention

    def counted(q, k_cache, v_cache, table, context, scale):
        calls.append((q.shape[0], context))
        return kernel_fn(q, k_cache, v_cache, table, context, scale)

    monkeypatch.setattr(paged_attention_cpu, "context_prefill_attention", counted)
    kernel = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert sorted(calls) == [(12, 988), (30, 170), (100, 0)]  # both later chunks and the first chunk
    monkeypatch.setenv("TRILLIUM_KERNELS", "reference")
    batch.meta.derived.clear()
    sdpa = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    torch.testing.assert_close(kernel, sdpa, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(kernel.double(), dense_causal_attention(batch), atol=2e-6, rtol=1e-5)


def test_windows_and_soft_capping_keep_the_gather_path(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the kernel has no window or soft-capping")

    monkeypatch.setattr(paged_attention_cpu, "context_prefill_attention", refuse)
    batch = make_paged_batch([40], [300], num_heads=8, num_kv_heads=4, head_dim=64, block_size=16, seed=2)
    windowed = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                         sliding_window=64)
    torch.testing.assert_close(windowed.double(), dense_causal_attention(batch, sliding_window=64), atol=2e-5,
                               rtol=1e-5)
    batch.meta.derived.clear()
    capped = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale, softcap=5.0)
    torch.testing.assert_close(capped.double(), dense_causal_attention(batch, softcap=5.0), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("what", ["bfloat16", "head dim 40", "group of 32", "int64 table", "strided table",
                                  "strided cache", "caches of two shapes", "reference switch"])
def test_what_it_does_not_take(what, monkeypatch):
    h, kh, d, dtype = 8, 4, 64, torch.float32
    if what == "bfloat16":
        dtype = torch.bfloat16
    elif what == "head dim 40":
        d = 40
    elif what == "group of 32":
        h, kh = 32, 1
    elif what == "reference switch":
        monkeypatch.setenv("TRILLIUM_KERNELS", "reference")
    batch = make_paged_batch([20], [50], num_heads=h, num_kv_heads=kh, head_dim=d, block_size=16, dtype=dtype)
    table, k_cache, v_cache = batch.meta.block_tables[0], batch.k_cache, batch.v_cache
    if what == "int64 table":
        table = table.long()
    elif what == "strided table":
        table = table.repeat_interleave(2)[::2]
    elif what == "strided cache":
        k_cache = k_cache.transpose(1, 2).contiguous().transpose(1, 2)
    elif what == "caches of two shapes":
        v_cache = v_cache[:-1]
    assert not paged_attention_cpu.context_prefill_supported(batch.q, k_cache, v_cache, table)


def test_a_table_too_short_for_the_keys_is_refused():
    batch = _batch((40, 50, 8, 4, 64, 16))
    table = batch.meta.block_tables[0][:5]  # 80 slots for 90 keys
    with pytest.raises(ValueError, match="does not hold 90 keys"):
        paged_attention_cpu.context_prefill_attention(batch.q, batch.k_cache, batch.v_cache, table, 40, batch.scale)


_CPU_FLAGS = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
_BUILDS = {"plain C": ("-O3",), "AVX2": ("-O3", "-mavx2", "-mfma")}


@pytest.mark.parametrize("build", [b for b in _BUILDS if b == "plain C" or " avx2 " in _CPU_FLAGS])
def test_builds_without_avx512_match_the_oracle(build):
    """Built as for a CPU without AVX-512 (no register transposes, 8-lane vectors) or without AVX2."""
    lib = CLibrary(paged_attention_cpu._SOURCE, f"the CPU attention kernels ({build})", paged_attention_cpu._declare,
                   flags=(*_BUILDS[build], "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11"))
    assert lib.get() is not None
    with using(paged_attention_cpu, lib):
        for case in CASES:
            batch = _batch(case, seed=sum(case))
            out = paged_attention_cpu.context_prefill_attention(batch.q, batch.k_cache, batch.v_cache,
                                                                batch.meta.block_tables[0], case[0], batch.scale)
            torch.testing.assert_close(out.double(), dense_causal_attention(batch), atol=2e-6, rtol=1e-5,
                                       msg=lambda m, case=case: f"{case}: {m}")
