"""--async-scheduling vs synchronous steps, side by side in one run (`bench/async_scheduling.py`).

On the `bench` model (float32 Llama, hidden 512, 8 layers): one in-process
engine per mode, both with the same compiled-decode setting (compiled at
--compile-batch-sizes unless --enforce-eager), rounds interleaved sync /
async so a loaded machine hurts both alike. Per round and mode:

  single stream   one request, 128-token prompt, 128 greedy tokens (EOS
                  ignored): tok/s = 128 / e2e, ITL = (e2e - TTFT) / 127,
                  TTFT from the same prompt with max_tokens 1
  B streams       --streams requests at once, 128 tokens each: tok/s

The in-process engine has no api / SSE hop and no ZeroMQ ipc (inproc://), so
this measures what async scheduling takes off the step's critical path: the
scheduler's result handling and planning and the executor's wait for its
next batch (the wake-ups `trillium bench timeline` shows). Both modes must
produce the same greedy tokens (checked). Prints medians; nothing is asserted
about speed.

On a shared machine a round's figures move by several times with the load
(one mode's tok/s ranged 6-28 in one run here), far more than the effect
measured, so the order alternates (sync first in even rounds, async first
in odd ones: neither always runs after the other), and each figure comes
with its min-max over the rounds and in how many paired rounds async was
ahead; a median of three rounds alone cannot tell a 0.5x from noise. With
compiled decode the run also counts Dynamo frame compiles during the
measured rounds (0: no recompile, no graph break, under either mode).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import torch


def _engine(model_dir: str, async_scheduling: bool, eager: bool, sizes: tuple[int, ...], threads: int):
    from trillium import LLM

    return LLM(model_dir, max_num_seqs=64, kv_cache_memory="256MiB", enforce_eager=eager,
               compile_batch_sizes=sizes, async_scheduling=async_scheduling, num_threads=threads)  # fmt: skip


def _generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    from trillium import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return elapsed, [list(o.outputs[0].token_ids) for o in outs]


def _round(llm, rng: random.Random, streams: int) -> tuple[dict[str, float], list]:
    prompt = [rng.randrange(4, 8192) for _ in range(128)]
    ttft, _ = _generate(llm, [prompt[:-1] + [rng.randrange(4, 8192)]], 1)
    e2e, single = _generate(llm, [prompt], 128)
    many, tokens = _generate(llm, [[rng.randrange(4, 8192) for _ in range(128)] for _ in range(streams)], 128)
    figures = {"single tok/s": 128 / e2e, "ITL ms": (e2e - ttft) / 127 * 1e3,
               f"{streams} streams tok/s": streams * 128 / many}  # fmt: skip
    return figures, single + tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6,
                        help="interleaved rounds per mode (median, min-max and paired wins reported)")
    parser.add_argument("--streams", type=int, default=16, help="concurrent requests of the batched figure")
    parser.add_argument("--compile-batch-sizes", default="1,2,4,8,16", help="compiled decode buckets")
    parser.add_argument("--enforce-eager", action="store_true", help="both engines eager")
    parser.add_argument("--executor-threads", type=int, default=0,
                        help="torch threads of both engines' executors (0: torch's default, every core)")
    parser.add_argument("--model-dir", default=None, help="the bench model (built there if missing)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from trillium.models.synthetic import build_checkpoint

    sizes = tuple(int(n) for n in args.compile_batch_sizes.split(","))
    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), "trillium-bench-model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_checkpoint(model_dir, "bench", seed=0)
    engines = {mode: _engine(model_dir, mode == "async", args.enforce_eager, sizes, args.executor_threads)
               for mode in ("sync", "async")}
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in engines}
    load_before = os.getloadavg()[0]
    try:
        for llm in engines.values():
            _round(llm, random.Random(-1), 1)  # warm-up
        frames = _frames_compiled()
        for r in range(args.rounds):
            tokens = {}
            for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
                figures, tokens[mode] = _round(engines[mode], random.Random(args.seed + r), args.streams)
                results[mode].append(figures)
                print(f"round {r} {mode}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()), flush=True)
            assert tokens["sync"] == tokens["async"], "async scheduling changed greedy tokens"
        recompiles = _frames_compiled() - frames
    finally:
        for llm in engines.values():
            llm.shutdown()
    print(f"\ntorch {torch.__version__}, {os.cpu_count()} CPUs, load average {load_before:.1f} -> "
          f"{os.getloadavg()[0]:.1f}, median of {args.rounds} interleaved rounds; "
          f"{'eager' if args.enforce_eager else 'compiled ' + args.compile_batch_sizes}, executor threads "
          f"{args.executor_threads or torch.get_num_threads()}")
    if not args.enforce_eager:
        print(f"Dynamo frames compiled during the rounds (both engines): {recompiles}")
    _report(results)
    return 0


def _frames_compiled() -> int:
    """Frames Dynamo has compiled in this process (a recompile or graph break adds to it)."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


def _report(results: dict[str, list[dict[str, float]]]) -> None:
    """Median per mode, async / sync, each mode's min-max, and the paired rounds async was ahead in."""
    print(f"{'':<22}{'sync':>10}{'async':>10}{'ratio':>7}   {'sync min-max':>15}{'async min-max':>16}  async ahead")
    for key in results["sync"][0]:
        rows = {m: [row[key] for row in results[m]] for m in ("sync", "async")}
        sync, fast = (statistics.median(rows[m]) for m in ("sync", "async"))
        lower_is_better = key.endswith("ms")
        ahead = sum((a < s) if lower_is_better else (a > s) for s, a in zip(rows["sync"], rows["async"]))
        spread = {m: f"{min(v):.1f}-{max(v):.1f}" for m, v in rows.items()}
        print(f"{key:<22}{sync:>10.2f}{fast:>10.2f}{fast / sync:>7.2f}   {spread['sync']:>15}{spread['async']:>16}"
              f"  {ahead}/{len(rows['sync'])}")


if __name__ == "__main__":
    raise SystemExit(main())
