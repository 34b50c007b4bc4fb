"""Compiled decode with Inductor's C++ wrapper vs its Python wrapper, in one run (`bench/graph_wrapper.py`).

One in-process executor (the `bench` model or --model) and two compiled
forwards of its model at batch 1: the C++ wrapper the executor uses
(executor/compiled_decode.py) and Inductor's default Python wrapper. Rounds
alternate the two on the same executor, cache and scheduler core (no IPC):
one request each, 128-token prompt, --tokens greedy tokens. Prints each
wrapper's median ms per decode step and tok/s, and whether the greedy tokens
agree; nothing is asserted. (Cold compile time: `bench/compiled_decode.py
--cold-warm`; here the second compile would reuse the first one's kernels.)
"""

from __future__ import annotations

import statistics

import torch

from trillium.benchmarks.weight_arena import decode_steps, in_process_engine, in_process_parser


def main(argv: list[str] | None = None) -> int:
    args = in_process_parser(__doc__).parse_args(argv)
    from trillium.actors.executor.compiled_decode import CompiledDecode

    core, sched = in_process_engine(args, enforce_eager=True)  # the two compiled forwards are set below
    forwards = {}
    for name, cpp_max in (("python", 0), ("c++", 1)):
        forwards[name] = CompiledDecode(core.model, (1,), cpp_wrapper_max_batch=cpp_max)
        forwards[name].native_decode = None  # the graphs themselves (native decode: bench/compiled_decode.py)
        forwards[name].warm_up()
    results = {name: {"step_s": [], "tokens": None} for name in forwards}
    with torch.inference_mode():
        for name, forward in forwards.items():
            core.forward = forward
            decode_steps(core, sched, f"warm-{name}", 16)
        for round_ in range(args.rounds):
            for name in (("python", "c++") if round_ % 2 == 0 else ("c++", "python")):
                core.forward = forwards[name]
                step_s, tokens = decode_steps(core, sched, f"r{round_}-{name}", args.tokens)
                results[name]["step_s"].extend(step_s)
                results[name]["tokens"] = results[name]["tokens"] or tokens
    print(f"threads {args.threads}, {args.rounds} rounds, batch 1, prompt 128, {args.tokens} tokens")
    print(f"{'wrapper':8} {'decode step ms':>15} {'tok/s':>7} {'graph steps':>12}")
    for name, row in results.items():
        step = statistics.median(row["step_s"])
        print(f"{name:8} {step * 1e3:15.3f} {1 / step:7.1f} {forwards[name].num_compiled_steps:12d}")
    ratio = statistics.median(results["python"]["step_s"]) / statistics.median(results["c++"]["step_s"])
    same = results["python"]["tokens"] == results["c++"]["tokens"]
    print(f"c++ / python wrapper decode speed: {ratio:.3f}x; greedy tokens identical: {same}")
    return 0
