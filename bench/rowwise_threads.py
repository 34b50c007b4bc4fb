"""The float32 row-wise ops (rowwise_cpu.c: RMSNorm, SiLU-and-mul, rope) at one thread and at N, in one run.

Run: .venv/bin/python bench/rowwise_threads.py [--threads N] [--rows 64,256,1024] [--rounds 5]
     .venv/bin/python bench/rowwise_threads.py --against REV   (REV's rowwise_cpu.c against today's, N threads)

The bench model's shapes (hidden 512, intermediate 1376, 8 / 4 heads of 64): per row count, one
layer's calls (two norms, one SiLU-and-mul, rope on q and k) through `rowwise_cpu`, microseconds,
medians of alternated rounds. One thread is how every call ran before the ops split rows across
threads (THREADED_ELEMENTS in the C file: calls of 32K elements or more); the split gives each row
the bits it gets alone (checked here too). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from trillium.kernels import rowwise_cpu


def _layer_calls(rows: int, gen: torch.Generator):
    x, w = torch.randn(rows, 512, generator=gen), torch.randn(512, generator=gen)
    gate_up = torch.randn(rows, 2752, generator=gen)
    qkv = torch.randn(rows, 1024, generator=gen)
    q, k = qkv[:, :512].view(rows, 8, 64), qkv[:, 512:768].view(rows, 4, 64)
    angles = torch.rand(4096, 32, generator=gen) * 50
    table, positions = torch.cat([angles.cos(), angles.sin()], dim=-1), torch.randint(0, 4096, (rows,), generator=gen)
    return {
        "rms_norm x2": lambda: (rowwise_cpu.rms_norm(x, w, 1e-5), rowwise_cpu.rms_norm(x, w, 1e-5)),
        "silu_and_mul": lambda: rowwise_cpu.silu_and_mul(gate_up),
        "rope q, k": lambda: rowwise_cpu.rotary_embedding(positions, q, k, table),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rows", default="64,256,1024", help="rows (tokens) per call, comma-separated")
    p.add_argument("--rounds", type=int, default=5, help="alternations of 1 and N threads; medians reported")
    p.add_argument("--repeats", type=int, default=50, help="calls timed per measurement")
    p.add_argument("--against", default=None, metavar="REV",
                   help="instead of 1 thread against N: rowwise_cpu.c as it was at git revision REV against "
                        "today's, both at N threads (a kernel change old against new, same bits checked)")
    args = p.parse_args()
    if args.threads < 2 and not args.against:
        raise SystemExit(f"--threads {args.threads}: give 2 or more (the baseline column is 1 thread)")
    if not rowwise_cpu.available():
        raise SystemExit(f"the row-wise kernels did not build: {rowwise_cpu.unavailable_reason()}")
    gen = torch.Generator().manual_seed(0)
    if args.against:
        _against(args, gen)
        return
    print(f"rowwise_cpu.c, bench model shapes, 1 thread against {args.threads}; us per call (layer's calls)")
    print(f"{'rows':>5} {'op':<14} {'1 thread':>9} {f'{args.threads} threads':>11} {'speed-up':>9} same bits")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, call in _layer_calls(rows, gen).items():
            (one, many), (one_out, many_out) = _alternate(
                call, [lambda: _threads(1), lambda: _threads(args.threads)], args.rounds, args.repeats)
            same = all(torch.equal(a, b) for a, b in zip(one_out, many_out))
            print(f"{rows:>5} {name:<14} {one * 1e6:>9.1f} {many * 1e6:>11.1f} {one / many:>8.2f}x {same}")
    torch.set_num_threads(args.threads)


def _threads(n: int) -> contextlib.AbstractContextManager:
    torch.set_num_threads(n)
    return contextlib.nullcontext()


def _alternate(call, setups: list, rounds: int, repeats: int) -> tuple[list[float], list[tuple]]:
    """`call` timed under each setup (a context-manager factory) in turn, `rounds` times: the median
    seconds per call of each, and each one's last outputs (as a tuple)."""
    times: list[list[float]] = [[] for _ in setups]
    outs: list[tuple] = [() for _ in setups]
    for _ in range(rounds):
        for i, setup in enumerate(setups):
            with setup():
                out = call()
                outs[i] = out if isinstance(out, tuple) else (out,)
                start = time.perf_counter()
                for _ in range(repeats):
                    call()
                times[i].append((time.perf_counter() - start) / repeats)
    return [statistics.median(t) for t in times], outs


def _against(args: argparse.Namespace, gen: torch.Generator) -> None:
    """REV's library and today's alternated at N threads: us per call, speed-up, same bits."""
    from trillium.benchmarks.revisions import library_at, using

    try:
        old = library_at(rowwise_cpu, args.against)
    except RuntimeError as exc:
        raise SystemExit(f"--against {args.against}: {exc}") from None
    torch.set_num_threads(args.threads)
    label = args.against[:12]
    print(f"rowwise_cpu.c, bench model shapes, {args.threads} threads, {label} against today's; us per call")
    print(f"{'rows':>5} {'op':<14} {label:>12} {'today':>9} {'speed-up':>9} same bits")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, call in _layer_calls(rows, gen).items():
            (before, now), (old_out, new_out) = _alternate(
                call, [lambda: using(rowwise_cpu, old), contextlib.nullcontext], args.rounds, args.repeats)
            same = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(old_out, new_out))
            print(f"{rows:>5} {name:<14} {before * 1e6:>12.1f} {now * 1e6:>9.1f} {before / now:>8.2f}x {same}")


if __name__ == "__main__":
    main()
