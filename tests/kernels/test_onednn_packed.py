"""kernels/onednn_packed.py: oneDNN on a weight packed once, and never on a stale copy.

The reference is x @ w.T (+ bias) in float32; the packed copy must follow every way weights change
(the loader's and updaters' `.data.copy_`, which torch's version counter does not see, the shadow
swap, the arena move) — a mutation that drops any of the forget() calls fails one of these.
"""

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from trillium.actors.executor.shadow_weights import ShadowWeights
from trillium.kernels import dense_cpu, onednn_packed
from trillium.models import weight_arena
from trillium.models.loader import load_model

pytestmark = pytest.mark.skipif(not (onednn_packed.available and onednn_packed.ENABLED),
                                reason="no oneDNN in this torch build")
ROWS = dense_cpu.MAX_ROWS + 17  # past dense_cpu: oneDNN's rows (the panel kernel's on a Zen 4: the same cache)


@pytest.fixture(autouse=True)
def _fresh():
    onednn_packed.forget()
    yield
    onednn_packed.forget()


def _param(*shape, generator=None) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape, generator=generator), requires_grad=False)


def _close(got, want):
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("n,k", [(1376, 512), (37, 19), (8, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_matches_float32_matmul_at_any_row_count(n, k, bias):
    g = torch.Generator().manual_seed(n + k)
    w = _param(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    with torch.no_grad():
        _check_rows(w, b, g, k, bias)
    assert onednn_packed.packed_bytes() == w.numel() * 4, "one packed copy, made once"


def _check_rows(w, b, g, k, bias):
    for rows in (1, 5, ROWS, 300):
        x = torch.randn(rows, k, generator=g)
        _close(onednn_packed.linear(x, w, b), x @ w.T + (b if bias else 0))
    x3 = torch.randn(3, 7, k, generator=g)  # leading dims kept
    _close(onednn_packed.linear(x3, w, b), x3 @ w.T + (b if bias else 0))


def test_the_copy_is_made_once_and_reused():
    w = _param(64, 32)
    x = torch.randn(ROWS, 32)
    onednn_packed.linear(x, w, None)
    first = onednn_packed._COPIES[(id(w), "onednn")].tensor
    onednn_packed.linear(x, w, None)
    assert onednn_packed._COPIES[(id(w), "onednn")].tensor is first


def test_forget_drops_a_copy_that_a_data_write_left_stale():
    w = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)
    x = torch.randn(ROWS, 32)
    onednn_packed.linear(x, w, None)
    w.data.copy_(torch.randn(64, 32))  # the loader's write: no version bump
    onednn_packed.forget()
    _close(onednn_packed.linear(x, w, None), x @ w.T)


def test_a_version_bump_or_new_storage_repacks_without_forget():
    w = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)
    x = torch.randn(ROWS, 32)
    onednn_packed.linear(x, w, None)
    with torch.no_grad():
        w.copy_(torch.randn(64, 32))
    _close(onednn_packed.linear(x, w, None), x @ w.T)
    w.data = torch.randn(64, 32)
    _close(onednn_packed.linear(x, w, None), x @ w.T)


@pytest.fixture
def model_and_weights(checkpoint):
    path = checkpoint("llama")
    model, _ = load_model(path, progress=False)
    return model, load_file(str(path / "model.safetensors"))


def _projection(model):
    return model.model.layers[0].mlp.gate_up_proj


def test_load_weights_and_the_shadow_swap_leave_no_stale_copy(model_and_weights):
    model, weights = model_and_weights
    proj = _projection(model)
    x = torch.randn(ROWS, proj.weight.shape[1])
    with torch.no_grad():
        _close(proj(x), x @ proj.weight.T)  # packed now
        assert onednn_packed.packed_bytes() > 0
        new = {name: torch.randn_like(t) for name, t in weights.items()}
        model.load_weights(new.items())
        _close(proj(x), x @ proj.weight.T)
        newer = {name: torch.randn_like(t) for name, t in weights.items()}
        shadow = ShadowWeights(model)
        names = tuple(newer)
        buffers, plan = shadow.buffers(names, tuple(t.dtype for t in newer.values()),
                                       tuple(tuple(t.shape) for t in newer.values()), torch.device("cpu"))
        for buffer, tensor in zip(buffers, newer.values()):
            buffer.copy_(tensor)
        before = proj.weight.detach().clone()
        shadow.swap_in(plan)
        assert not torch.equal(before, proj.weight)
        _close(proj(x), x @ proj.weight.T)


def test_the_arena_move_drops_the_copies(model_and_weights):
    model, weights = model_and_weights
    twin = type(model)(model.config, dtype=model.dtype)  # outside an arena, as before the loader's move
    twin.load_weights(weights.items())
    proj = _projection(twin)
    with torch.no_grad():
        proj(torch.randn(ROWS, proj.weight.shape[1]))
    assert onednn_packed.packed_bytes() > 0
    assert weight_arena.pack(twin) is not None
    assert onednn_packed.packed_bytes() == 0


def test_an_unknown_switch_value_is_refused_at_import():
    env = {**os.environ, "TRILLIUM_ONEDNN_PACKED": "yes"}
    run = subprocess.run([sys.executable, "-c", "import trillium.kernels.onednn_packed"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "TRILLIUM_ONEDNN_PACKED='yes'" in run.stderr


def test_sleep_level_2_drops_the_copies_with_the_weights(model_and_weights):
    from types import SimpleNamespace

    from trillium.actors.executor.memory import DeviceMemory

    model, _ = model_and_weights
    proj = _projection(model)
    with torch.no_grad():
        proj(torch.randn(ROWS, proj.weight.shape[1]))
    assert onednn_packed.packed_bytes() > 0
    DeviceMemory(SimpleNamespace(model=model, kv_caches=[], device=torch.device("cpu"))).sleep(2)
    assert onednn_packed.packed_bytes() == 0


def test_an_inference_tensor_weight_is_packed_too():
    with torch.inference_mode():
        w = _param(64, 32)  # no version counter: forget() alone guards it
    x = torch.randn(ROWS, 32)
    _close(onednn_packed.linear(x, w, None), x @ w.T)
    assert onednn_packed.packed_bytes() == w.numel() * 4


def test_a_weight_made_for_one_call_is_not_packed_and_a_freed_parameter_takes_its_copy_along():
    x = torch.randn(ROWS, 32)
    temporary = torch.randn(64, 32)  # as a GGUF / int4 layer's dequantized matrix
    _close(onednn_packed.linear(x, temporary, None), x @ temporary.T)
    assert onednn_packed.packed_bytes() == 0
    w = _param(64, 32)
    onednn_packed.linear(x, w, None)
    assert onednn_packed.packed_bytes() == w.numel() * 4
    del w
    assert onednn_packed.packed_bytes() == 0 and not onednn_packed._COPIES
