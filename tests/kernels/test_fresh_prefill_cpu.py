"""The CPU causal prefill attention kernel (paged_attention_cpu.c `trillium_fresh_prefill_attention`).

Oracles: a float64 causal softmax(q k^T * scale) v per sequence and head (written out here, GQA by
index), and torch's SDPA (the path fresh_prefill.attend_run took before, and still takes under
TRILLIUM_KERNELS=reference). Odd shapes: lengths 1 to 300 around the kernel's 16-position query
blocks and 64-key blocks, GQA groups 1 to 8, head dims 16 / 32 / 64 / 128, several sequences in a run,
q / k / v as the strided slices of one qkv projection (as the model hands them in).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trillium.benchmarks.revisions import using
from trillium.kernels import paged_attention_cpu
from trillium.kernels.c_library import CLibrary
from trillium.kernels.fresh_prefill import Run, attend_run

pytestmark = pytest.mark.skipif(not paged_attention_cpu.available(), reason="no C compiler for the kernel")


def _qkv(num_seqs: int, q_len: int, h: int, kh: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_seqs * q_len, (h + 2 * kh) * d, generator=g)
    q, k, v = qkv.split([h * d, kh * d, kh * d], dim=-1)
    return q.view(-1, h, d), k.view(-1, kh, d), v.view(-1, kh, d)


def _oracle(q, k, v, num_seqs: int, q_len: int, scale: float) -> torch.Tensor:
    h, kh = q.shape[1], k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    causal = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    for s in range(num_seqs):
        rows = slice(s * q_len, (s + 1) * q_len)
        for head in range(h):
            qh, kv = q[rows, head].double(), head // (h // kh)
            scores = (qh @ k[rows, kv].double().T * scale).masked_fill(~causal, float("-inf"))
            out[rows, head] = torch.softmax(scores, -1) @ v[rows, kv].double()
    return out


CASES = [  # (sequences, q_len, H, KH, D)
    (1, 1, 8, 4, 64),
    (1, 7, 8, 4, 64),
    (1, 16, 8, 4, 64),
    (1, 17, 8, 4, 64),
    (1, 64, 4, 4, 64),
    (1, 65, 9, 3, 64),
    (1, 300, 8, 4, 64),
    (3, 33, 8, 2, 64),
    (2, 100, 4, 4, 128),
    (1, 129, 8, 1, 32),
    (4, 20, 16, 2, 16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_the_kernel_matches_causal_attention_in_float64(case):
    num_seqs, q_len, h, kh, d = case
    q, k, v = _qkv(*case, seed=sum(case))
    assert paged_attention_cpu.prefill_supported(q, k, v)
    out = paged_attention_cpu.fresh_prefill_attention(q, k, v, num_seqs, q_len, d**-0.5)
    torch.testing.assert_close(out.double(), _oracle(q, k, v, num_seqs, q_len, d**-0.5), atol=2e-6, rtol=1e-5)


def test_attend_run_gives_sdpas_result_with_the_kernel_and_sdpa_itself_under_the_reference_switch(monkeypatch):
    q, k, v = _qkv(3, 40, 8, 4, 64, seed=1)
    rows = slice(40, 120)  # the run: sequences 1 and 2 of the step's rows
    run = Run(rows, 2, 40)
    kernel = attend_run(q, k, v, run, 0.125, True)
    monkeypatch.setenv("TRILLIUM_KERNELS", "reference")
    assert not paged_attention_cpu.prefill_supported(q, k, v)
    sdpa = attend_run(q, k, v, run, 0.125, True)
    torch.testing.assert_close(kernel, sdpa, atol=2e-6, rtol=1e-5)
    oracle = _oracle(q[rows], k[rows], v[rows], 2, 40, 0.125)
    torch.testing.assert_close(kernel.double(), oracle, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("what", ["bfloat16", "head dim 40", "group of 32"])
def test_shapes_and_dtypes_it_does_not_take_go_to_sdpa(what):
    h, kh, d, dtype = 8, 4, 64, torch.float32
    if what == "bfloat16":
        dtype = torch.bfloat16
    elif what == "head dim 40":
        d = 40
    else:
        h, kh = 32, 1
    q, k, v = (t.to(dtype) for t in _qkv(1, 20, h, kh, d, seed=3))
    assert not paged_attention_cpu.prefill_supported(q, k, v)
    out = attend_run(q, k, v, Run(slice(0, 20), 1, 20), d**-0.5, kh != h)
    assert out.dtype == dtype and out.shape == (20, h, d)


_CPU_FLAGS = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
_BUILDS = {"plain C": ("-O3",), "AVX2": ("-O3", "-mavx2", "-mfma")}


@pytest.mark.parametrize("build", [b for b in _BUILDS if b == "plain C" or " avx2 " in _CPU_FLAGS])
def test_builds_without_avx512_match_the_oracle(build):
    """The source built as a CPU without AVX-512 (8-lane vectors, the AVX2 softmax) or without AVX2 (the
    plain softmax loop) builds it: every case matches the float64 oracle, whichever build is this
    machine's own."""
    lib = CLibrary(paged_attention_cpu._SOURCE, f"the CPU attention kernels ({build})", paged_attention_cpu._declare,
                   flags=(*_BUILDS[build], "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11"))
    assert lib.get() is not None
    with using(paged_attention_cpu, lib):
        for case in CASES:
            num_seqs, q_len, h, kh, d = case
            q, k, v = _qkv(*case, seed=sum(case))
            out = paged_attention_cpu.fresh_prefill_attention(q, k, v, num_seqs, q_len, d**-0.5)
            torch.testing.assert_close(out.double(), _oracle(q, k, v, num_seqs, q_len, d**-0.5), atol=2e-6,
                                       rtol=1e-5, msg=lambda m, case=case: f"{case}: {m}")
