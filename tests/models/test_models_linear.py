"""`llama.linear`: float32 CPU inference on oneDNN, F.linear everywhere else.

oneDNN blocks the matmul differently from MKL, so results agree to ~1e-6
relative, not bit for bit; it reads the plain weights on every call, so
in-place weight updates are seen at once.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trillium.models import llama


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_inference_matches_f_linear(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=gen) * 0.1
    b = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 80, generator=gen)
    with torch.inference_mode():
        _close(llama.linear(x, w, b), F.linear(x, w, b))
        x3 = x.view(1, rows, 80)
        _close(llama.linear(x3, w, b), F.linear(x3, w, b))
        assert llama.linear(x[:0], w, b).shape == (0, 96)


def test_sees_in_place_weight_updates() -> None:
    layer = llama.Linear(16, 24, bias=False)
    x = torch.randn(5, 16)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(-2.0)
        _close(layer(x), before * -2.0)
        layer.weight.copy_(torch.ones(24, 16))
        _close(layer(x), x.sum(-1, keepdim=True).expand(5, 24))


def test_grad_mode_and_other_dtypes_are_plain_f_linear() -> None:
    w = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(3, 4)
    y = llama.linear(x, w)
    assert torch.equal(y, F.linear(x, w))
    y.sum().backward()
    assert w.grad is not None
    xb, wb = x.bfloat16(), w.detach().bfloat16()
    with torch.inference_mode():
        assert torch.equal(llama.linear(xb, wb), F.linear(xb, wb))
