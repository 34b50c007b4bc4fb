"""kernels/panel_cpu.py: float32 linears past dense_cpu's rows on panel-packed weights (AVX-512F CPUs).

The reference is the float64 product rounded to float32; a row's bits must not depend on the rows
beside it or the threads; the panels live in onednn_packed's cache, so they follow weight writes
the same way (test_onednn_packed.py's model tests run through this kernel on an AVX-512F machine).
"""

import os
import subprocess
import sys

import pytest
import torch

from trillium.kernels import dense_cpu, onednn_packed, padded_rows, panel_cpu
from trillium.models import llama

built = pytest.mark.skipif(not panel_cpu.available(), reason=f"panel kernel: {panel_cpu.unavailable_reason()}")
LOW = dense_cpu.MAX_ROWS + 1  # the fewest rows it takes


@pytest.fixture(autouse=True)
def _fresh():
    onednn_packed.forget()
    yield
    onednn_packed.forget()


def _param(n, k, generator):
    return torch.nn.Parameter(torch.randn(n, k, generator=generator), requires_grad=False)


def _reference(x, w, b):
    out = x.double() @ w.double().T
    return (out if b is None else out + b.double()).float()


def _close(got, x, w, b=None):
    torch.testing.assert_close(got, _reference(x, w, b), atol=1e-4, rtol=1e-5)


def _copies_after_a_linear(env: dict) -> subprocess.CompletedProcess:
    """A fresh process runs llama.linear on 40 rows of a parameter under `env` and prints the kinds
    of packed copy it made (the switches are read at import)."""
    code = ("import torch; from trillium.kernels import onednn_packed as o; from trillium.models import llama;"
            "w = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False);"
            "torch.set_grad_enabled(False); llama.linear(torch.randn(40, 32), w);"
            "print(sorted(k for _, k in o._COPIES))")
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


@built
@pytest.mark.parametrize("n,k", [(1024, 512), (512, 1376), (48, 64), (47, 33), (49, 1), (97, 515), (70, 24), (5, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_matches_float64_at_every_row_count_it_takes(n, k, bias):
    g = torch.Generator().manual_seed(n * 31 + k)
    w = _param(n, k, g)
    b = torch.randn(n, generator=g) if bias else None
    for rows in (LOW, LOW + 1, 19, 21, 22, 24, 31, 33, 64, 71, 128, 257, 600):  # every tile height 1-8
        if rows < LOW:
            continue
        x = torch.randn(rows, k, generator=g)
        assert panel_cpu.takes(x, w, b)
        got = panel_cpu.linear(x, w, b)
        # float32 FMA chains over K against float64: the error grows with K and the sums' size
        torch.testing.assert_close(got, _reference(x, w, b), atol=2e-5 * k ** 0.5 * 4, rtol=1e-5)
    panels = -(-n // panel_cpu.WIDTH)
    assert onednn_packed.packed_bytes() == panels * panel_cpu.WIDTH * k * 4, "one panel copy, made once"


@built
def test_strided_rows_read_in_place():
    g = torch.Generator().manual_seed(3)
    w = _param(100, 40, g)
    wide = torch.randn(40, 64, generator=g)
    x = wide[:, 7:47]  # rows 64 floats apart
    assert panel_cpu.takes(x, w, None)
    _close(panel_cpu.linear(x, w, None), x, w)


@built
def test_a_rows_bits_do_not_depend_on_the_batch_or_the_threads():
    g = torch.Generator().manual_seed(5)
    w = _param(300, 512, g)
    b = torch.randn(300, generator=g)
    x = torch.randn(600, 512, generator=g)  # three blocks of rows (panel_cpu.c's ROW_BLOCK 256)
    full = panel_cpu.linear(x, w, b)
    for rows in (LOW, 20, 33, 64, 100, 256, 300):
        assert torch.equal(panel_cpu.linear(x[:rows].clone(), w, b), full[:rows])
        assert torch.equal(panel_cpu.linear(x[-rows:].clone(), w, b), full[-rows:])  # other tile positions
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = panel_cpu.linear(x, w, b)
        torch.set_num_threads(3)
        assert torch.equal(panel_cpu.linear(x, w, b), alone)
    finally:
        torch.set_num_threads(threads)


@built
def test_what_it_does_not_take():
    g = torch.Generator().manual_seed(7)
    w = _param(64, 32, g)
    x = torch.randn(40, 32, generator=g)
    assert panel_cpu.takes(x, w, None)
    assert not panel_cpu.takes(x[:LOW - 1], w, None), "dense_cpu's rows"
    assert not panel_cpu.takes(x, w.detach().clone(), None), "a weight made for one call is not packed"
    assert not panel_cpu.takes(torch.randn(32, 40).T, w, None), "rows with a stride inside them"
    assert not panel_cpu.takes(x.unsqueeze(0), w, None)
    assert not panel_cpu.takes(x[:, :16], w, None), "K does not fit the weight"
    assert not panel_cpu.takes(x, w, torch.randn(128)[::2]), "a strided bias"
    assert onednn_packed.packed_bytes() == 0


@built
def test_a_write_to_the_weight_is_seen_after_forget_and_a_version_bump_without():
    g = torch.Generator().manual_seed(9)
    w = _param(64, 32, g)
    x = torch.randn(40, 32, generator=g)
    panel_cpu.linear(x, w, None)
    w.data.copy_(torch.randn(64, 32, generator=g))  # the loader's write: no version bump
    onednn_packed.forget()
    _close(panel_cpu.linear(x, w, None), x, w)
    with torch.no_grad():
        w.copy_(torch.randn(64, 32, generator=g))  # a version bump
    _close(panel_cpu.linear(x, w, None), x, w)


@built
def test_llama_linear_sends_rows_past_dense_cpus_here_and_a_plain_tensor_to_onednn():
    g = torch.Generator().manual_seed(11)
    w = _param(96, 64, g)
    with torch.no_grad():
        for rows in (LOW - 1, LOW, 40, 1000):
            onednn_packed.forget()
            x = torch.randn(rows, 64, generator=g)
            _close(llama.linear(x, w), x, w)
            assert [k for _, k in onednn_packed._COPIES] == ([] if rows < LOW else ["panel"])
        onednn_packed.forget()
        temporary = w.detach().clone()  # a GGUF / int4 layer's per-call matrix: oneDNN, nothing packed
        x = torch.randn(40, 64, generator=g)
        _close(llama.linear(x, temporary), x, w)
        assert onednn_packed.packed_bytes() == 0


@built
def test_one_cache_for_both_kinds_a_freed_parameter_takes_its_panels_along_and_inference_tensors():
    g = torch.Generator().manual_seed(13)
    w = _param(64, 32, g)
    x = torch.randn(40, 32, generator=g)
    panel_cpu.linear(x, w, None)
    onednn_packed.linear(x, w, None)
    kinds = sorted(k for _, k in onednn_packed._COPIES)
    assert kinds == (["onednn", "panel"] if onednn_packed.ENABLED else ["panel"])
    onednn_packed.forget()
    assert onednn_packed.packed_bytes() == 0
    panel_cpu.linear(x, w, None)
    del w
    assert not onednn_packed._COPIES, "the panels went with their parameter"
    with torch.inference_mode():
        v = _param(64, 32, g)  # no version counter: forget() alone guards it
    _close(panel_cpu.linear(x, v, None), x, v)


@built
def test_a_compiled_graphs_call_computes_the_live_rows_only():
    g = torch.Generator().manual_seed(17)
    w = _param(96, 64, g)
    x = torch.randn(64, 64, generator=g)  # a 64-row bucket with 40 live rows
    with torch.no_grad(), padded_rows.live_rows(40):
        out = torch.ops.trillium.cpu_linear(x, w, None)
    _close(out[:40], x[:40], w)
    assert not out[40:].any()
    assert [k for _, k in onednn_packed._COPIES] == ["panel"]


def test_the_reference_switch_keeps_the_plain_path():
    run = _copies_after_a_linear({"TRILLIUM_KERNELS": "reference"})
    assert run.returncode == 0, run.stderr
    assert "panel" not in run.stdout


@pytest.mark.parametrize("value,ok", [("0", True), ("yes", False)])
def test_the_switch(value, ok):
    run = _copies_after_a_linear({"TRILLIUM_PANEL_LINEAR": value})
    if ok:
        assert run.returncode == 0, run.stderr
        assert "panel" not in run.stdout, "TRILLIUM_PANEL_LINEAR=0 keeps those rows on oneDNN"
    else:
        assert run.returncode != 0 and "TRILLIUM_PANEL_LINEAR='yes'" in run.stderr
