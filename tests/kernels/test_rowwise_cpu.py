"""The float32 row-wise ops on CPU (trillium/kernels/rowwise_cpu.c) against kernels/reference.py.

RMSNorm and SiLU-and-mul fix their own summation order and exp, so they match the reference to
float32 rounding (a few ulp); rope computes the reference's products and sums and matches it bit for
bit. Each row's result must depend on that row alone -- not on how many rows share the call, their
strides or where the row sits -- since compiled decode and eager steps rely on it for the same bits
(dispatch.py). Calls the kernel does not take return None (the caller runs the reference).
"""

from __future__ import annotations

import pytest
import torch

from trillium.kernels import dispatch, reference, rowwise_cpu

pytestmark = pytest.mark.skipif(not rowwise_cpu.available(), reason=f"no C kernel: {rowwise_cpu.unavailable_reason()}")


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error in units of float32 epsilon relative to the row's largest magnitude."""
    scale = want.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    return float(((got - want).abs() / scale).max() / torch.finfo(torch.float32).eps)


@pytest.mark.parametrize("n", [1, 7, 16, 17, 576, 1001])
def test_rms_norm_matches_the_reference(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    weight = torch.randn(n, generator=gen)
    for x in (torch.randn(n, generator=gen), torch.randn(5, n, generator=gen) * 40,
              torch.randn(4, 3, 2 * n, generator=gen)[:, :, 1 : n + 1]):  # 1-D, 2-D, 3-D strided
        got = rowwise_cpu.rms_norm(x, weight, 1e-6)
        assert got is not None and got.is_contiguous() and got.shape == x.shape
        assert _ulps(got, reference.rms_norm(x, weight, 1e-6)) < 8


@pytest.mark.parametrize("inter", [1, 15, 16, 33, 1536])
def test_silu_and_mul_matches_the_reference(inter: int) -> None:
    gen = torch.Generator().manual_seed(inter)
    x = torch.randn(6, 2 * inter, generator=gen) * 6
    got = rowwise_cpu.silu_and_mul(x)
    want = reference.silu_and_mul(x)
    assert got is not None and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-30)
    strided = torch.randn(6, 2 * inter + 3, generator=gen)[:, 3:]  # rows at a stride of their own
    torch.testing.assert_close(rowwise_cpu.silu_and_mul(strided), reference.silu_and_mul(strided), rtol=4e-7,
                               atol=1e-30)


def test_silu_saturates_and_propagates_nan() -> None:
    gate = torch.tensor([-1e4, -100.0, -87.0, -20.0, -1e-20, 0.0, 1e-20, 20.0, 100.0, 1e4, float("nan")])
    got = rowwise_cpu.silu_and_mul(torch.cat([gate, torch.ones_like(gate)])[None])[0]
    want = reference.silu_and_mul(torch.cat([gate, torch.ones_like(gate)])[None])[0]
    torch.testing.assert_close(got[:-1], want[:-1], rtol=4e-7, atol=1e-35)
    assert got[-1].isnan()
    x = torch.ones(2, 8)
    x[1, 3] = float("nan")
    norm = rowwise_cpu.rms_norm(x, torch.ones(8), 1e-6)
    assert norm[1].isnan().all() and not norm[0].isnan().any()  # a NaN spoils its row only


def test_silu_vector_lanes_and_scalar_tail_give_the_same_bits() -> None:
    """SiLU-and-mul runs 8 lanes at a time (AVX2) and the last inter % 8 elements of a row one by one:
    the same gate and up values must give the same bits in a lane as in the tail, random values over
    many scales and the edges of exp's range (clamps, overflow to inf, denormal products, NaN)."""
    gen = torch.Generator().manual_seed(7)
    edges = torch.tensor([88.3762626647949, 88.37627, 88.4, 89.0, 87.3365447504, 87.34, 88.0, 100.0, 104.0,
                          -88.3762626647949, -87.3365447504, -87.34, -88.7, -104.0, 0.0, -0.0, 1e-30, -1e-30,
                          1e-45, 3.4e38, -3.4e38, float("inf"), -float("inf"), float("nan")])
    values = torch.cat([edges, *(torch.randn(4000, generator=gen) * scale for scale in (1e-3, 0.3, 3, 30, 90))])
    values = torch.cat([values, values.new_zeros(-len(values) % 7)]).view(-1, 7)  # 7 per row: lanes 0-6, tail 8-14
    ups = torch.randn(values.shape, generator=gen) * 1e-30 ** torch.randint(0, 2, values.shape, generator=gen)
    inter = 15
    x = torch.zeros(len(values), 2 * inter)
    x[:, 0:7], x[:, 8:15] = values, values
    x[:, inter : inter + 7], x[:, inter + 8 : 2 * inter] = ups, ups
    got = rowwise_cpu.silu_and_mul(x)
    assert torch.equal(got[:, 0:7].view(torch.int32), got[:, 8:15].view(torch.int32))


def test_rope_is_the_reference_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(9, (4 + 2 * 2) * 34, generator=gen)
    q = qkv[:, : 4 * 34].view(9, 4, 34)  # views of one fused projection, rows strided
    k = qkv[:, 4 * 34 : 6 * 34].view(9, 2, 34)
    angles = torch.rand(300, 17, generator=gen) * 50
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.randint(0, 300, (9,), generator=gen)
    got_q, got_k = rowwise_cpu.rotary_embedding(positions, q, k, table)
    want_q, want_k = reference.rotary_embedding(positions, q, k, table)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_a_rows_bits_depend_on_that_row_alone() -> None:
    """The same row alone, in a batch of 37 at any place, copied contiguous, or strided."""
    gen = torch.Generator().manual_seed(11)
    batch = torch.randn(37, 2 * 579 + 5, generator=gen)
    x, weight = batch[:, 5 : 5 + 579], torch.randn(579, generator=gen)
    gate_up = batch[:, 5:]
    full_norm, full_silu = rowwise_cpu.rms_norm(x, weight, 1e-5), rowwise_cpu.silu_and_mul(gate_up)
    for row in (0, 13, 36):
        assert torch.equal(rowwise_cpu.rms_norm(x[row : row + 1].contiguous(), weight, 1e-5), full_norm[row : row + 1])
        assert torch.equal(rowwise_cpu.rms_norm(x[row], weight, 1e-5), full_norm[row])
        assert torch.equal(rowwise_cpu.silu_and_mul(gate_up[row : row + 1].contiguous()), full_silu[row : row + 1])


def test_threaded_calls_give_each_row_its_bits_alone() -> None:
    """A prefill-sized call (past THREADED_ELEMENTS: rows split across threads) gives every row the
    bits it gets alone at one thread, for each op."""
    gen = torch.Generator().manual_seed(12)
    rows = 600  # every call past the threshold: rope's k is 600 x 2 x 34 = 40800 elements
    batch = torch.randn(rows, 2 * 579 + 5, generator=gen)
    x, weight, gate_up = batch[:, 5 : 5 + 579], torch.randn(579, generator=gen), batch[:, 5:]
    heads = x[:, :576].reshape(rows, 4, 144)  # the 3-D norm (q / k norms): rows split across both dims
    qkv = torch.randn(rows, 6 * 34, generator=gen)
    q, k = qkv[:, : 4 * 34].view(rows, 4, 34), qkv[:, 4 * 34 :].view(rows, 2, 34)
    angles = torch.rand(400, 17, generator=gen) * 50
    table, positions = torch.cat([angles.cos(), angles.sin()], dim=-1), torch.randint(0, 400, (rows,), generator=gen)

    def calls():
        return (rowwise_cpu.rms_norm(x, weight, 1e-5), rowwise_cpu.rms_norm(heads, weight[:144], 1e-5),
                rowwise_cpu.silu_and_mul(gate_up), *rowwise_cpu.rotary_embedding(positions, q, k, table))

    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        threaded = calls()
        norm, _, silu, rq, rk = threaded
        torch.set_num_threads(1)
        assert all(torch.equal(a, b) for a, b in zip(threaded, calls()))
        for row in (0, 299, rows - 1):
            one = slice(row, row + 1)
            assert torch.equal(rowwise_cpu.rms_norm(x[one].contiguous(), weight, 1e-5), norm[one])
            assert torch.equal(rowwise_cpu.silu_and_mul(gate_up[one].contiguous()), silu[one])
            got_q, got_k = rowwise_cpu.rotary_embedding(positions[one], q[one], k[one], table)
            assert torch.equal(got_q, rq[one]) and torch.equal(got_k, rk[one])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(rq, reference.rotary_embedding(positions, q, k, table)[0])


def test_what_it_does_not_take_is_none() -> None:
    x, weight = torch.randn(3, 8), torch.randn(8)
    assert rowwise_cpu.rms_norm(x.double(), weight.double(), 1e-6) is None
    assert rowwise_cpu.rms_norm(torch.randn(8, 3).t(), weight, 1e-6) is None  # last dimension strided
    assert rowwise_cpu.rms_norm(torch.randn(2, 2, 2, 8), weight, 1e-6) is None  # three leading dimensions
    assert rowwise_cpu.rms_norm(x, torch.randn(7), 1e-6) is None
    assert rowwise_cpu.silu_and_mul(torch.randn(3, 7)) is None
    assert rowwise_cpu.silu_and_mul(torch.randn(2, 3, 8)) is None
    table, q, k = torch.randn(16, 8), torch.randn(2, 3, 8), torch.randn(2, 1, 8)
    assert rowwise_cpu.rotary_embedding(torch.tensor([3, 16]), q, k, table) is None  # outside the table
    assert rowwise_cpu.rotary_embedding(torch.tensor([3, 1], dtype=torch.int32), q, k, table) is None
    assert rowwise_cpu.rotary_embedding(torch.tensor([3, 1]), q, k, table[:, :6]) is None


def test_dispatch_runs_it_for_cpu_float32_and_the_reference_otherwise() -> None:
    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(4, 64, generator=gen), torch.randn(64, generator=gen)
    assert torch.equal(dispatch.rms_norm(x, weight, 1e-6), rowwise_cpu.rms_norm(x, weight, 1e-6))
    assert torch.equal(dispatch.silu_and_mul(x), rowwise_cpu.silu_and_mul(x))
    half = x.bfloat16()
    assert torch.equal(dispatch.rms_norm(half, weight.bfloat16(), 1e-6), reference.rms_norm(half, weight.bfloat16(), 1e-6))
    with pytest.raises(IndexError):  # the reference's error for a position outside the table
        dispatch.rotary_embedding(torch.tensor([20]), torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.randn(16, 8))
