"""The packed GGUF CPU kernel (trillium/kernels/gguf_cpu.c) against dequantize-then-matmul.

The reference is gguf-py's own `gguf.quants.dequantize` (what transformers'
and Trillium's float GGUF path use) followed by a float64 matmul; the blocks
come from gguf-py's quantizers (Q4_K / Q5_K / Q6_K, which gguf-py only
decodes, from trillium.models.gguf_kquant_encode, written to ggml's layout:
ggml-org/llama.cpp ggml/src/ggml-common.h block_q4_K / block_q5_K / block_q6_K),
so every format is checked on its own values. Shapes: K a multiple of the 32-weight block only (no larger tile; for the
K-quants one and three 256-weight super-blocks), N not a multiple of any
vector width, batches 1, a partial row tile and several tiles. Mirrors the split vLLM's GGUF linear makes
(vllm-project/vllm vllm/model_executor/layers/quantization/gguf.py
`_fused_mul_mat_gguf`: a vector kernel for a few rows, dequantize + GEMM above).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from trillium.kernels import gguf_cpu
from trillium.kernels.c_library import CLibrary
from trillium.models import gguf_kquant_encode
from trillium.models.packed_linear import DEQUANTIZE_ROWS, DEQUANTIZE_ROWS_INT8, GgufLinear

pytestmark = pytest.mark.skipif(not gguf_cpu.available(), reason="no C compiler for the packed kernel")
FORMATS = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
           GGMLQuantizationType.Q5_1]
K_FORMATS = [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K]


def packed(n: int, k: int, qtype: GGMLQuantizationType, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [n, row bytes], the float32 weights they hold [n, k])."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.01).astype(np.float32)
    blocks = gguf_kquant_encode.quantize(w, qtype) if qtype in K_FORMATS else quantize(w, qtype)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(dequantize(blocks, qtype).copy())


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("n, k", [(40, 96), (33, 32), (130, 160)])
@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_matmul_matches_dequantize_then_matmul(qtype, n, k, m):
    blocks, w = packed(n, k, qtype, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = gguf_cpu.matmul(x, blocks, int(qtype), k)
    ref = (x.double() @ w.double().T).float()
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 kernel sees it (gguf_cpu.c "int8 activations", after llama.cpp's quantize_row_q8_1):
    per 32 values d = max|x| / 127, q = rint(x * (1 / d)) (float32 arithmetic), back as d * q (float64)."""
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    d = np.abs(xb).max(-1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.rint(xb * inv[..., None])
    assert np.abs(q).max() <= 127
    return torch.from_numpy((q.astype(np.float64) * d[..., None]).reshape(x.shape))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("n, k", [(40, 96), (33, 32), (130, 288)])
@pytest.mark.parametrize("m", [1, 3, 5, 8, 17])
def test_int8_activations_match_their_reference(qtype, n, k, m):
    """The integer dots are exact, so the kernel equals (quantized x) @ dequantized W up to float32
    summation; K 96 and 288 leave a partial group of 8 blocks (the kernel's tail); where K > 32 one
    block of x is all zeros (d = 0). And the result is not the float path's: the mode is really taken."""
    blocks, w = packed(n, k, qtype, seed=n + k + 1)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 100))
    if k > 32:
        x[0, :32] = 0.0
    out = gguf_cpu.matmul(x, blocks, int(qtype), k, activations="int8")
    ref = (int8_activations(x) @ w.double().T).float()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    exact = (x.double() @ w.double().T).float()
    assert (out - exact).abs().max() > 1e-4


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_0],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("k", [96, 320])  # 3 blocks: the tail only; 10: a group of 8 and a tail of 2
def test_int8_every_row_count_equals_its_rows_one_at_a_time(qtype, k):
    """The int8 kernel's row tiles (8 rows with AVX-512, else 4; 9 rows: 8 + 1 or 4 + 4 + 1): each row
    computed alike at any row count
    (Q5_0 at K = 96 caught the compiler fusing a * b + c in one row count's function and not another's)."""
    blocks, _ = packed(45, k, qtype, seed=4)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(10))
    singles = torch.cat([gguf_cpu.matmul(x[r : r + 1], blocks, int(qtype), k, "int8") for r in range(9)])
    for m in range(1, 10):
        assert torch.equal(gguf_cpu.matmul(x[:m], blocks, int(qtype), k, "int8"), singles[:m]), m


def test_int8_activations_refused_for_the_kquants_and_bad_modes():
    kblocks, _ = packed(8, 256, GGMLQuantizationType.Q4_K)
    with pytest.raises(ValueError, match="Q4_K has no int8-activation kernel"):
        gguf_cpu.matmul(torch.randn(1, 256), kblocks, int(GGMLQuantizationType.Q4_K), 256, "int8")
    blocks, _ = packed(8, 64, GGMLQuantizationType.Q4_1)
    with pytest.raises(ValueError, match="activations must be"):
        gguf_cpu.matmul(torch.randn(1, 64), blocks, 3, 64, "bf16")
    layer = GgufLinear(kblocks, int(GGMLQuantizationType.Q4_K), 256, None, activations="int8")
    assert layer.activations == "float32" and "activations=float32" in repr(layer)  # no int8 kernel: float
    assert gguf_cpu.matmul(torch.randn(0, 64), blocks, 3, 64, "int8").shape == (0, 8)  # no rows, no buffer


@pytest.mark.parametrize("qtype", K_FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("n, k", [(37, 256), (130, 768)])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_kquant_matmul_matches_dequantize_then_matmul(qtype, n, k, m):
    blocks, w = packed(n, k, qtype, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = gguf_cpu.matmul(x, blocks, int(qtype), k)
    assert out.shape == (m, n) and blocks.shape == (n, k // 256 * gguf_cpu.BLOCK_BYTES[int(qtype)])
    torch.testing.assert_close(out, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", K_FORMATS, ids=lambda t: t.name)
def test_kquant_encoder_writes_what_gguf_py_reads(qtype):
    """The test encoder's bytes decode (by gguf-py, independently) to values near the weights:
    relative RMS error below the format's step (a misplaced field would scramble them)."""
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((16, 512)) * 0.05).astype(np.float32)
    back = dequantize(gguf_kquant_encode.quantize(w, qtype), qtype)
    rel = np.sqrt(((back - w) ** 2).mean() / (w**2).mean())
    assert rel < {"Q4_K": 0.09, "Q5_K": 0.045, "Q6_K": 0.03}[qtype.name]


@pytest.mark.parametrize("qtype", FORMATS + K_FORMATS, ids=lambda t: t.name)
def test_dequantize_is_the_formats_values(qtype):
    blocks, w = packed(70, 256 if qtype in K_FORMATS else 128, qtype)
    # Bit for bit: d * q is exact in float32, so a fused d * q + m (Q4_1) rounds once, as numpy does.
    assert torch.equal(gguf_cpu.dequantize(blocks, int(qtype), w.shape[1]), w)


def test_strided_rows_and_bad_inputs():
    blocks, w = packed(48, 64, GGMLQuantizationType.Q4_1)
    wide = torch.randn(5, 80)
    x = wide[:, 8:72]  # row stride 80, unit column stride: read in place
    torch.testing.assert_close(gguf_cpu.matmul(x, blocks, 3, 64), x @ w.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="K % 32"):
        gguf_cpu.matmul(torch.randn(1, 48), blocks, 3, 48)
    with pytest.raises(ValueError, match="Q4_1 rows of K=64"):
        gguf_cpu.matmul(torch.randn(1, 64), blocks[:, :-1].contiguous(), 3, 64)
    with pytest.raises(ValueError, match="no packed CPU kernel"):
        gguf_cpu.matmul(torch.randn(1, 64), blocks, int(GGMLQuantizationType.Q2_K), 64)
    kblocks, _ = packed(8, 256, GGMLQuantizationType.Q4_K)
    with pytest.raises(ValueError, match="K % 256"):  # a super-block is 256 weights
        gguf_cpu.matmul(torch.randn(1, 128), kblocks[:, :144].contiguous(), int(GGMLQuantizationType.Q4_K), 128)
    with pytest.raises(ValueError, match="float32"):
        gguf_cpu.matmul(torch.randn(1, 64, dtype=torch.bfloat16), blocks, 3, 64)


@pytest.mark.parametrize("rows", [1, DEQUANTIZE_ROWS, DEQUANTIZE_ROWS + 1, 100])
def test_gguf_linear_both_paths_with_bias(rows):
    """Decode-sized batches run the packed kernel, larger ones dequantize + oneDNN: same result."""
    blocks, w = packed(72, 96, GGMLQuantizationType.Q8_0)
    bias = torch.randn(72)
    layer = GgufLinear(blocks, int(GGMLQuantizationType.Q8_0), 96, bias)
    x = torch.randn(1, rows, 96)
    with torch.no_grad():
        out = layer(x)
    assert out.shape == (1, rows, 72)
    torch.testing.assert_close(out, (x.double() @ w.double().T + bias.double()).float(), rtol=1e-5, atol=1e-5)
    assert "format=Q8_0" in repr(layer) and [n for n, _ in layer.named_parameters()] == ["bias"]


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q6_K],
                         ids=lambda t: t.name)
def test_every_row_count_equals_its_rows_one_at_a_time(qtype):
    """Each row count up to the tile has its own kernel function (gguf_cpu.c's dot_table; 9 rows are a
    full tile and a 1-row one); a row's result must not
    depend on how many rows share its tile: a speculative verify row equals its decode step bit for bit."""
    k = 256
    blocks, w = packed(45, k, qtype, seed=3)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(9))
    singles = torch.cat([gguf_cpu.matmul(x[r : r + 1], blocks, int(qtype), k) for r in range(9)])
    ref = (x.double() @ w.double().T).float()
    for m in range(1, 10):
        out = gguf_cpu.matmul(x[:m], blocks, int(qtype), k)
        assert torch.equal(out, singles[:m]), m
        torch.testing.assert_close(out, ref[:m], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [DEQUANTIZE_ROWS + 1, DEQUANTIZE_ROWS_INT8, DEQUANTIZE_ROWS_INT8 + 1])
def test_int8_layer_keeps_the_packed_kernel_up_to_its_own_limit(rows):
    """With int8 activations the packed kernel serves up to DEQUANTIZE_ROWS_INT8 rows (bit for bit the
    int8 matmul); larger batches run the int8 GEMM where it has its VNNI path (bit for bit gemm_int8),
    else dequantize for oneDNN (the float result)."""
    blocks, w = packed(40, 96, GGMLQuantizationType.Q4_1)
    bias = torch.randn(40)
    layer = GgufLinear(blocks, int(GGMLQuantizationType.Q4_1), 96, bias, activations="int8")
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        out = layer(x)
    if rows <= DEQUANTIZE_ROWS_INT8:
        assert torch.equal(out, gguf_cpu.matmul(x, blocks, 3, 96, "int8") + bias)
    elif gguf_cpu.gemm_int8_vectorized():
        assert torch.equal(out, gguf_cpu.gemm_int8(x, blocks, 3, 96) + bias)
    else:
        torch.testing.assert_close(out, (x.double() @ w.double().T + bias.double()).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("n, k", [(40, 96), (16, 32), (33, 288), (130, 160)])  # N: whole tiles of 16 and tails
@pytest.mark.parametrize("m", [1, 7, 8, 9, 70])  # the GEMM's passes of 8 rows and their tails
def test_int8_gemm_matches_its_reference_and_the_decode_kernel(qtype, n, k, m):
    """The many-row int8 path (gguf_cpu.c "many rows": codes repacked per tile of 16 weight rows) is
    (quantized x) @ dequantized W up to float32 summation, one all-zero block of x included, and the
    decode kernel's result bit for bit (both sum each output's blocks in order, one lane per output):
    a row's logits do not depend on how many rows its step has."""
    blocks, w = packed(n, k, qtype, seed=n * k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 7))
    if k > 32:
        x[0, 32:64] = 0.0
    out = gguf_cpu.gemm_int8(x, blocks, int(qtype), k)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, (int8_activations(x) @ w.double().T).float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(out, gguf_cpu.decode_int8(x, blocks, int(qtype), k))
    assert torch.equal(out, gguf_cpu.matmul(x, blocks, int(qtype), k, "int8"))  # whichever it picks


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_1],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("kernel", ["gemm_int8", "fused_int8"])
def test_int8_gemm_rows_do_not_depend_on_the_other_rows_or_threads(qtype, kernel):
    """A prefill row's result is the same whatever chunk it is in, its place in a pass of 8, or the
    thread count (tiles split over threads), strided rows too: bit for bit; the buffered GEMM and its
    fused passes alike."""
    if kernel == "fused_int8" and not gguf_cpu.gemm_int8_vectorized():
        pytest.skip("the fused pass needs AVX-512 VNNI")
    run = getattr(gguf_cpu, kernel)
    k = 160
    blocks, _ = packed(50, k, qtype, seed=5)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(11))
    whole = run(x, blocks, int(qtype), k)
    for start, stop in ((0, 1), (3, 12), (5, 19), (18, 19)):
        assert torch.equal(run(x[start:stop], blocks, int(qtype), k), whole[start:stop])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(run(x, blocks, int(qtype), k), whole)
    finally:
        torch.set_num_threads(threads)
    strided = torch.randn(19, 2 * k)
    strided[:, :k] = x
    assert torch.equal(run(strided[:, :k], blocks, int(qtype), k), whole)


@pytest.mark.skipif(not gguf_cpu.gemm_int8_vectorized(), reason="the fused pass needs AVX-512 VNNI")
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
@pytest.mark.parametrize("n, k", [(48, 96), (16, 32), (33, 288), (130, 160)])  # N: whole tiles of 16 and tails
def test_int8_fused_pass_matches_the_decode_kernel_at_every_row_count(qtype, n, k):
    """The GEMM's fused passes (8 rows a pass; each block's codes unpacked and transposed in registers: Q4_0 /
    Q4_1 nibbles after one 4 x 4 dword transpose, the other formats through gemm_pack's two 8 x 8) is its
    quantized reference and the decode kernel's result bit for bit at 1..9, 15 and 16 rows, a short last
    tile of N included, and it is what `matmul` runs for those rows (a verify step's or small batch's row has the
    bits it would have in a decode step or a prefill chunk)."""
    blocks, w = packed(n, k, qtype, seed=n * k + 3)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(n + k))
    if k > 32:
        x[1, 32:64] = 0.0
        x[9, 32:64] = 0.0
    ref = (int8_activations(x) @ w.double().T).float()
    for m in (*range(1, 10), 15, 16):
        out = gguf_cpu.fused_int8(x[:m], blocks, int(qtype), k)
        torch.testing.assert_close(out, ref[:m], rtol=1e-5, atol=1e-5)
        assert torch.equal(out, gguf_cpu.decode_int8(x[:m], blocks, int(qtype), k)), m
        assert torch.equal(out, gguf_cpu.gemm_int8(x[:m], blocks, int(qtype), k)), m
        assert torch.equal(out, gguf_cpu.matmul(x[:m], blocks, int(qtype), k, "int8")), m


@pytest.mark.skipif(not gguf_cpu.gemm_int8_vectorized(), reason="the fused pass needs AVX-512 VNNI")
def test_int8_fused_pass_refusals():
    """More than FUSED_PASSES_MAX_ROWS rows, a K-quant and a K of no whole blocks are refused (its rows,
    threads and strides: test_int8_gemm_rows_do_not_depend_on_the_other_rows_or_threads)."""
    k = 160
    qtype = GGMLQuantizationType.Q4_1
    blocks, _ = packed(64, k, qtype, seed=9)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=f"at most {gguf_cpu.FUSED_PASSES_MAX_ROWS} rows"):
        gguf_cpu.fused_int8(torch.randn(gguf_cpu.FUSED_PASSES_MAX_ROWS + 1, k), blocks, int(qtype), k)
    kblocks, _ = packed(16, 256, GGMLQuantizationType.Q4_K)
    with pytest.raises(ValueError, match="Q4_K has no int8-activation kernel"):
        gguf_cpu.fused_int8(torch.randn(2, 256), kblocks, int(GGMLQuantizationType.Q4_K), 256)
    lib = gguf_cpu._LIBRARY.get()
    out = torch.empty(2, 16)
    assert lib.trillium_gguf_fused_q8(int(qtype), x.data_ptr(), 2, 40, 40, blocks.data_ptr(), 16, out.data_ptr(),
                                      1) == -1  # K not whole blocks
    big = torch.randn(gguf_cpu.FUSED_PASSES_MAX_ROWS + 1, k)
    assert lib.trillium_gguf_fused_q8(int(qtype), big.data_ptr(), big.shape[0], k, k, blocks.data_ptr(), 16,
                                      out.data_ptr(), 1) == -1  # more rows than FUSED_PASSES_MAX_ROWS


_CPU_FLAGS = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
_BUILDS = {"plain C": ("-O2",), "AVX2": ("-O2", "-mavx2", "-mfma", "-mf16c")}


@pytest.mark.parametrize("build", [b for b in _BUILDS if b == "plain C" or " avx2 " in _CPU_FLAGS])
def test_int8_paths_of_other_builds_give_the_same_bits(build):
    """The same source built for a machine without AVX-512 (AVX2: the decode kernel's 256-bit path, the
    GEMM's plain loops) or without AVX2 (plain C everywhere) gives this build's int8 results bit for bit,
    decode kernel and GEMM alike, with its refusals."""
    lib = CLibrary(gguf_cpu._SOURCE, f"the GGUF CPU kernel ({build})", gguf_cpu._declare,
                   flags=(*_BUILDS[build], "-fopenmp", "-shared", "-fPIC", "-std=c11")).get()
    assert lib is not None
    assert lib.trillium_gguf_gemm_q8_vectorized() == 0
    assert lib.trillium_gguf_fused_q8(int(FORMATS[0]), 0, 1, 32, 32, 0, 16, 0, 1) == -1  # not built there
    for qtype in FORMATS:
        n, k, m = 35, 96, 10
        blocks, _ = packed(n, k, qtype, seed=int(qtype))
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(int(qtype)))
        for fn in (lib.trillium_gguf_gemm_q8, lib.trillium_gguf_decode_q8, lib.trillium_gguf_matmul_q8):
            out = torch.empty(m, n)
            assert fn(int(qtype), x.data_ptr(), m, k, k, blocks.data_ptr(), n, out.data_ptr(), 1) == 0
            assert torch.equal(out, gguf_cpu.gemm_int8(x, blocks, int(qtype), k)), (qtype.name, fn.__name__)
    assert lib.trillium_gguf_gemm_q8(int(GGMLQuantizationType.Q4_K), x.data_ptr(), m, 256, 256, blocks.data_ptr(),
                                       n, out.data_ptr(), 1) == -1
    assert lib.trillium_gguf_gemm_q8(int(GGMLQuantizationType.Q4_1), x.data_ptr(), m, 40, 40, blocks.data_ptr(),
                                       n, out.data_ptr(), 1) == -1  # K not whole blocks


def test_int8_gemm_refuses_what_the_decode_kernel_refuses():
    kblocks, _ = packed(8, 256, GGMLQuantizationType.Q4_K)
    with pytest.raises(ValueError, match="Q4_K has no int8-activation kernel"):
        gguf_cpu.gemm_int8(torch.randn(80, 256), kblocks, int(GGMLQuantizationType.Q4_K), 256)
    blocks, _ = packed(8, 64, GGMLQuantizationType.Q4_1)
    with pytest.raises(ValueError, match="float32"):
        gguf_cpu.gemm_int8(torch.randn(80, 64, dtype=torch.bfloat16), blocks, 3, 64)
    with pytest.raises(ValueError, match="rows of K=96"):
        gguf_cpu.gemm_int8(torch.randn(80, 96), blocks, 3, 96)
    assert gguf_cpu.gemm_int8(torch.randn(0, 64), blocks, 3, 64).shape == (0, 8)


def test_padding_rows_are_skipped_only_under_the_hint():
    """kernels/padded_rows.py: inside live_rows(n) a packed projection computes rows < n (the same
    values) and leaves the rest zero (then the bias is added); outside, and on another thread, every row
    is computed."""
    import threading

    from trillium.kernels import padded_rows

    blocks, w = packed(40, 96, GGMLQuantizationType.Q4_1)
    bias = torch.randn(40)
    layer = GgufLinear(blocks, int(GGMLQuantizationType.Q4_1), 96, bias)
    x = torch.randn(8, 96)
    with torch.no_grad():
        full = layer(x)
        with padded_rows.live_rows(3):
            part = layer(x)
            seen = []
            thread = threading.Thread(target=lambda: seen.append(padded_rows.live()))
            thread.start()
            thread.join()
        after = layer(x)
    assert torch.equal(part[:3], full[:3]) and torch.equal(part[3:], bias.expand(5, 40))
    assert torch.equal(after, full) and seen == [None] and padded_rows.live() is None
