"""The int4 CPU kernel (trillium/kernels/int4_cpu.c) on AWQ / GPTQ weights against dequantize-then-matmul.

The packed tensors come from tests/support/int4_writer.py, which packs as AutoAWQ
(casper-hansen/AutoAWQ awq/modules/linear/gemm.py) and AutoGPTQ
(AutoGPTQ/AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py) do, and the reference
dequantizes as vLLM reads them (vllm-project/vllm vllm/model_executor/layers/quantization/awq_triton.py:
nibble order 0 4 1 5 2 6 3 7; csrc/quantization/gptq/q_gemm.cu: v1 zeros + 1), followed by a float64
matmul. Shapes: out sizes that are multiples of 8 only (the packing's unit), batch 1, a partial row
tile, a full one and, through `Int4Linear`, the dequantize + oneDNN path above DEQUANTIZE_ROWS.
"""

from __future__ import annotations

import pytest
import torch

from support.int4_writer import dequantize_awq, dequantize_gptq, pack_awq, pack_gptq, quantize_groups
from trillium.kernels import int4_cpu
from trillium.models.int4_checkpoint import Int4Weight
from trillium.models.int4_linear import DEQUANTIZE_ROWS, Int4Linear

pytestmark = pytest.mark.skipif(not int4_cpu.available(), reason="no C compiler for the int4 kernel")
FLAVOURS = ["awq", "gptq-v1-sym", "gptq-v2", "gptq-v2-act-order"]


def packed(flavour: str, n: int, k: int, group: int, seed: int) -> tuple[Int4Weight, torch.Tensor]:
    """(our repacked weight, the float32 [n, k] weight the checkpoint tensors hold)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05 + torch.randn(n, 1, generator=gen) * 0.02
    g_idx = None
    if flavour.endswith("act-order"):
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[torch.randperm(k, generator=gen)] = torch.arange(k) // group
    q, zeros, scales = quantize_groups(w, group, sym=flavour == "gptq-v1-sym", g_idx=g_idx)
    if flavour == "awq":
        t = pack_awq(q, zeros, scales)
        return Int4Weight.from_awq(t["qweight"], t["qzeros"], t["scales"], group), dequantize_awq(t, group)
    v2 = "v2" in flavour
    t = pack_gptq(q, zeros, scales, torch.arange(k) // group if g_idx is None else g_idx, v2)
    weight = Int4Weight.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group, 0 if v2 else 1)
    return weight, dequantize_gptq(t, v2)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("n, k, group", [(136, 256, 128), (24, 128, 128), (40, 192, 64)])
def test_matmul_matches_dequantize_then_matmul(flavour, n, k, group):
    weight, w = packed(flavour, n, k, group, seed=n + k)
    layer = Int4Linear(weight, None, flavour)
    # The packed layout holds exactly the checkpoint's weights (in group order under act order).
    order = slice(None) if weight.perm is None else weight.perm
    assert torch.equal(int4_cpu.dequantize(weight.qs, weight.sz, group), w[:, order])
    assert torch.equal(weight.dequantize(), w)
    for m in (1, 3, 8, 9):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        ref = (x.double() @ w.double().t()).float()
        got = layer(x)
        assert got.shape == (m, n) and torch.allclose(got, ref, atol=1e-5, rtol=1e-5), m


@pytest.mark.parametrize("flavour", ["awq", "gptq-v2-act-order"])
def test_layer_bias_prefill_path_and_per_channel_group(flavour):
    """Above DEQUANTIZE_ROWS rows the layer dequantizes once and runs oneDNN; group -1 is one group of K."""
    k = 128
    for group in (128, k):  # group_size -1 reaches here as K
        weight, w = packed(flavour, 56, k, group, seed=group)
        bias = torch.randn(56)
        layer = Int4Linear(weight, bias, flavour)
        x = torch.randn(2, DEQUANTIZE_ROWS // 2 + 3, k)  # 38 rows: the float path
        ref = (x.double() @ w.double().t() + bias.double()).float()
        assert torch.allclose(layer(x), ref, atol=1e-5, rtol=1e-5)
        assert torch.allclose(layer(x[0, :1]), ref[0, :1], atol=1e-5, rtol=1e-5)


def test_bad_layouts_are_errors():
    weight, _ = packed("awq", 16, 128, 128, seed=0)
    with pytest.raises(ValueError, match="group size 48"):
        int4_cpu.matmul(torch.zeros(1, 128), weight.qs, weight.sz, 48)
    with pytest.raises(ValueError, match="x must be float32"):
        int4_cpu.matmul(torch.zeros(1, 64), weight.qs, weight.sz, 128)
    with pytest.raises(ValueError, match="in_features 100"):
        Int4Weight.build(torch.zeros(100, 8, dtype=torch.uint8), torch.zeros(1, 8), torch.ones(1, 8), 100)
    g_idx = torch.zeros(128, dtype=torch.int64)  # every input in group 0: not a GPTQ act order
    with pytest.raises(ValueError, match="g_idx does not put exactly 64"):
        Int4Weight.build(torch.zeros(128, 8, dtype=torch.uint8), torch.zeros(2, 8), torch.ones(2, 8), 64, g_idx)
