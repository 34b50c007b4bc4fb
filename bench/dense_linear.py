"""float32 linears of a decode step: dense_cpu.c against oneDNN, at a few batch sizes, in one run.

Run: .venv/bin/python bench/dense_linear.py [--rows 1,2,4,8,16,24,32] [--threads N] [--repeats 30]

The `bench` model's shapes (hidden 512, 8 layers: qkv 1024x512, o 512x512,
gate_up 2752x512, down 512x1376, and the 8192x512 LM head: 33 products, 110 MB
of float32 weights, more than any cache here) with random weights; one "step"
multiplies M activation rows through all 33, as a decode step of M sequences
does. Per M: ms per step of trillium/kernels/dense_cpu.c (what `llama.linear`
runs up to dense_cpu.MAX_ROWS rows) and of oneDNN's `_linear_pointwise` (what
it runs above, on the plain weights as before kernels/onednn_packed.py), of
oneDNN on its packed copy of each weight (what `llama.linear` runs past dense_cpu's
rows where the panel kernel is not used), and on an AVX-512F CPU other than Intel's
of kernels/panel_cpu.c on its panel copy (what `llama.linear` runs past dense_cpu's
rows there), alternated
--rounds times (a shared machine drifts), medians, and the weight bytes per second
each reads. Where dense_cpu.c builds its 512-bit
tiles (`dense_cpu.WIDE`: an Intel CPU with AVX-512) the same source built with
the 256-bit tiles (the baseline: what ran before, and what runs elsewhere) is one
more column. `--against REV` adds the same file at git revision REV as a column (a kernel change
old against new in one run; trillium/benchmarks/revisions.py) and checks the two give the same bits.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trillium.kernels import dense_cpu, onednn_packed, panel_cpu
from trillium.kernels.c_library import FLAGS, CLibrary

SHAPES = ((1024, 512), (512, 512), (2752, 512), (512, 1376))  # one layer's (N, K)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16,24,32", help="activation rows M per step, comma-separated")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=30, help="steps timed per measurement")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the kernels; medians reported")
    p.add_argument("--against", default=None, metavar="REV",
                   help="also time dense_cpu.c as it was at git revision REV (e.g. HEAD~1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not dense_cpu.available():
        raise SystemExit(f"the dense kernel did not build: {dense_cpu.unavailable_reason()}")
    onednn = torch.ops.mkldnn._linear_pointwise
    gen = torch.Generator().manual_seed(0)
    # WHY parameters: onednn_packed and panel_cpu pack only parameters (a model's weights), and a plain
    # tensor would send their columns to the unpacked path
    weights = [_param(n, k, gen) for _ in range(8) for n, k in SHAPES]
    weights.append(_param(8192, 512, gen))
    nbytes = sum(w.numel() * 4 for w in weights)
    kernels = {
        "dense_cpu.c": lambda x, w: dense_cpu.linear(x, w),
        "oneDNN": lambda x, w: onednn(x, w, None, "none", [], ""),
        "oneDNN packed": lambda x, w: onednn_packed.linear(x, w, None),
    }
    if panel_cpu.available():
        kernels["panel"] = lambda x, w: panel_cpu.linear(x, w)
    narrow = _narrow_tiles() if dense_cpu.WIDE else None
    if narrow is not None:
        kernels["256-bit tiles"] = narrow
    if args.against:
        kernels[args.against] = _at_revision(args.against)
    print(f"{len(weights)} float32 weights, {nbytes / 1e6:.0f} MB per step, {args.threads} threads, "
          f"dense_cpu.MAX_ROWS = {dense_cpu.MAX_ROWS}, {dense_cpu.vector_bits()}-bit tiles")
    print(f"{'rows':>5} {'dense_cpu.c ms':>15} {'GB/s':>6} {'oneDNN ms':>10} {'GB/s':>6} {'speedup':>8}"
          f" {'packed ms':>10} {'over oneDNN':>12}"
          + (f" {'panel ms':>9} {'over packed':>12}" if "panel" in kernels else "")
          + (f" {'256-bit tiles ms':>17} {'speedup':>8}" if narrow else "")
          + (f" {args.against[:12] + ' ms':>17} {'speedup':>8} same bits" if args.against else ""))
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen) for k in {w.shape[1] for w in weights}}
        # the kernels of ours this M is timed on must give x @ w.T first
        checked = [dense_cpu.linear] if m <= dense_cpu.MAX_ROWS else []
        checked += [panel_cpu.linear] if "panel" in kernels else []
        for k, x in xs.items():
            w = next(w for w in weights if w.shape[1] == k)
            for fn in checked:
                torch.testing.assert_close(fn(x, w), x @ w.T, atol=1e-3, rtol=1e-4)
        times: dict[str, list[float]] = {name: [] for name in kernels}
        with torch.inference_mode():
            for _ in range(args.rounds):
                for name, fn in kernels.items():
                    for _ in range(3):
                        for w in weights:
                            fn(xs[w.shape[1]], w)
                    start = time.perf_counter()
                    for _ in range(args.repeats):
                        for w in weights:
                            fn(xs[w.shape[1]], w)
                    times[name].append((time.perf_counter() - start) / args.repeats)
        medians = {name: statistics.median(t) for name, t in times.items()}
        dense, dnn, packed = medians.pop("dense_cpu.c"), medians.pop("oneDNN"), medians.pop("oneDNN packed")
        panel = medians.pop("panel", None)
        rest = list(medians.values())
        same = ""
        if args.against and m <= dense_cpu.MAX_ROWS:
            x, w = xs[512], weights[0]
            same = f" {torch.equal(dense_cpu.linear(x, w), kernels[args.against](x, w))}"
        print(f"{m:>5} {dense * 1e3:>15.2f} {nbytes / dense / 1e9:>6.1f} {dnn * 1e3:>10.2f} "
              f"{nbytes / dnn / 1e9:>6.1f} {dnn / dense:>7.2f}x {packed * 1e3:>10.2f} {dnn / packed:>11.2f}x"
              + ("" if panel is None else f" {panel * 1e3:>9.2f} {packed / panel:>11.2f}x")
              + "".join(f" {t * 1e3:>17.2f} {t / dense:>7.2f}x" for t in rest) + same)


def _param(n: int, k: int, gen: torch.Generator) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(n, k, generator=gen), requires_grad=False)


def _at_revision(rev: str):
    """dense_cpu.c as it was at git revision `rev` (built with today's flags), as a linear(x, w) function."""
    from trillium.benchmarks.revisions import library_at

    try:
        return _linear_with(library_at(dense_cpu, rev).get())
    except RuntimeError as exc:
        raise SystemExit(f"--against {rev}: {exc}") from None


def _narrow_tiles():
    """dense_cpu.c built without TRILLIUM_DENSE_512 (its 256-bit tiles), as a linear(x, w) function."""
    lib = CLibrary(dense_cpu._SOURCE, "the 256-bit tiles", dense_cpu._declare, flags=FLAGS).get()
    if lib is None:
        return None
    assert lib.trillium_f32_linear_vector_bits() != 512
    return _linear_with(lib)


def _linear_with(lib):
    """linear(x, w) through a build of dense_cpu.c called directly (as dense_cpu.linear calls its own)."""

    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], w.shape[0])
        rc = lib.trillium_f32_linear(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), w.data_ptr(), w.shape[0],
                                     None, out.data_ptr(), torch.get_num_threads())
        assert rc == 0
        return out

    return linear


if __name__ == "__main__":
    main()
