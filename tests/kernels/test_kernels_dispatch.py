"""Kernel dispatch: CPU tensors take the torch reference, and importing or
calling the kernels on CPU never imports triton."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from support.paged_batches import make_paged_batch, rope_cache
import trillium.kernels as kernels
from trillium.kernels import dispatch, reference

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_package_exports_the_dispatchers() -> None:
    for name in ("rms_norm", "silu_and_mul", "rotary_embedding", "write_kv_cache", "paged_attention"):
        assert getattr(kernels, name) is getattr(dispatch, name)


def test_cpu_calls_never_import_triton() -> None:
    """In a fresh interpreter: import the kernels, run every op on CPU; triton stays unloaded."""
    script = textwrap.dedent(
        """
        import sys
        import torch
        import trillium.kernels as K
        assert "triton" not in sys.modules, "import trillium.kernels pulled in triton"
        x = torch.randn(3, 16)
        K.rms_norm(x, torch.ones(16), 1e-6)
        K.silu_and_mul(x)
        q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
        cs = torch.cat([torch.ones(4, 4), torch.zeros(4, 4)], -1)
        K.rotary_embedding(torch.tensor([0, 1]), q, k, cs)
        kc, vc = torch.zeros(2, 16, 2, 8), torch.zeros(2, 16, 2, 8)
        K.write_kv_cache(k, k, kc, vc, torch.tensor([0, 1]))
        meta = K.AttentionMetadata.build([2], [2], [[0]], 16)
        K.paged_attention(q, kc, vc, meta, 0.5)
        assert "triton" not in sys.modules, "a CPU call imported triton"
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_routing_predicate(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA + triton + no override -> Triton; CPU or TRILLIUM_KERNELS=reference -> torch."""
    cuda_like = SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.delenv(dispatch.KERNELS_ENV, raising=False)
    assert dispatch.wants_triton(cuda_like)
    assert not dispatch.wants_triton(torch.zeros(1))
    monkeypatch.setenv(dispatch.KERNELS_ENV, "reference")
    assert not dispatch.wants_triton(cuda_like)
    monkeypatch.setenv(dispatch.KERNELS_ENV, "triton")
    assert dispatch.wants_triton(cuda_like)
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    assert not dispatch.wants_triton(cuda_like)


def test_cpu_results_are_the_reference() -> None:
    """Norm and SiLU: the reference to float32 rounding (rowwise_cpu.c fixes its own summation order
    and exp; tests/kernels/test_rowwise_cpu.py), or exactly where that kernel is not built; rope and
    prefill attention: the reference bit for bit."""
    from trillium.kernels import rowwise_cpu

    gen = torch.Generator().manual_seed(0)
    x = torch.randn((4, 32), generator=gen)
    w = torch.randn(32, generator=gen)
    exact = not rowwise_cpu.available()
    for got, want in ((kernels.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6)),
                      (kernels.silu_and_mul(x), reference.silu_and_mul(x))):
        torch.testing.assert_close(got, want, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6)
    q, k = torch.randn((4, 4, 16), generator=gen), torch.randn((4, 2, 16), generator=gen)
    positions = torch.tensor([3, 0, 9, 1])
    got = kernels.rotary_embedding(positions, q, k, rope_cache(10, 16))
    want = reference.rotary_embedding(positions, q, k, rope_cache(10, 16))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # prefill chunks only: the reference (a mixed step's decode rows take the CPU decode kernel, and pure
    # decode steps too: tests/kernels/test_paged_attention_cpu.py)
    batch = make_paged_batch([2, 5], [20, 5], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    got = kernels.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    want = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert torch.equal(got, want)
