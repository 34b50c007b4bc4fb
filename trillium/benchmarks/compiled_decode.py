"""Compiled decode vs eager, side by side in one run (`bench/compiled_decode.py`).

On the `bench` model (float32 Llama, hidden 512, 8 layers; --model-dir another
HF dir or a .gguf file): one in-process engine per mode, rounds interleaved so
a loaded machine hurts all alike:

  eager      --enforce-eager
  graphs     compiled at --compile-batch-sizes with native decode off
             (TRILLIUM_NATIVE_DECODE=0): every decode step runs its bucket's graph
  compiled   compiled as `trillium serve` runs it: decode steps native
             (models/native_decode.py: one C++ call a forward), the graphs
             for what native decode does not take

Per round and mode:

  single stream   one request, 128-token prompt, 128 greedy tokens (EOS
                  ignored): tok/s = 128 / e2e, ITL = (e2e - TTFT) / 127,
                  TTFT from the same prompt with max_tokens 1
  B streams       --streams requests at once (decode steps of B rows, the
                  compiled bucket B pads to), 128 tokens each: tok/s

Start-up: seconds to build each engine (the compiled one includes compiling
every bucket). With --cold-warm, two fresh processes build the compiled
engine against one empty Inductor cache dir: the first compiles (cold), the
second reads the on-disk cache (warm).

Prints medians of --rounds rounds; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from unittest import mock

import torch


def _engine(model_dir: str, eager: bool, sizes: tuple[int, ...], native: bool = True):
    from trillium import LLM

    start = time.perf_counter()
    # read as the engine builds its forward
    with mock.patch.dict(os.environ, {"TRILLIUM_NATIVE_DECODE": "1" if native else "0"}):
        llm = LLM(model_dir, max_num_seqs=64, kv_cache_memory="256MiB", enforce_eager=eager,
                  compile_batch_sizes=sizes)  # fmt: skip
    return llm, time.perf_counter() - start


def _generate_s(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from trillium import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return elapsed


def _round(llm, rng: random.Random, streams: int) -> dict[str, float]:
    prompt = [rng.randrange(4, 8192) for _ in range(128)]
    ttft = _generate_s(llm, [prompt[:-1] + [rng.randrange(4, 8192)]], 1)
    e2e = _generate_s(llm, [prompt], 128)
    many = _generate_s(llm, [[rng.randrange(4, 8192) for _ in range(128)] for _ in range(streams)], 128)
    return {"single tok/s": 128 / e2e, "ITL ms": (e2e - ttft) / 127 * 1e3, f"{streams} streams tok/s":
            streams * 128 / many}  # fmt: skip


def _compile_only(model_dir: str, sizes: tuple[int, ...]) -> float:
    llm, seconds = _engine(model_dir, False, sizes)
    llm.shutdown()
    return seconds


def _cold_warm(model_dir: str, sizes: str) -> tuple[float, float]:
    cache = tempfile.mkdtemp(prefix="trillium-inductor-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    times = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-m", "trillium.benchmarks.compiled_decode", "--model-dir", model_dir,
                              "--compile-batch-sizes", sizes, "--start-only"],
                             env=env, check=True, capture_output=True, text=True)  # fmt: skip
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return times[0], times[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per mode (median reported)")
    parser.add_argument("--streams", type=int, default=8, help="concurrent requests of the batched figure")
    parser.add_argument("--compile-batch-sizes", default="1,2,4,8", help="buckets of the compiled engine")
    parser.add_argument("--model-dir", default=None, help="the bench model (built there if missing)")
    parser.add_argument("--cold-warm", action="store_true", help="also time a cold and a warm compiled start")
    parser.add_argument("--start-only", action="store_true", help=argparse.SUPPRESS)  # --cold-warm's child
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from trillium.models.synthetic import build_checkpoint

    sizes = tuple(int(n) for n in args.compile_batch_sizes.split(","))
    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), "trillium-bench-model")
    if not model_dir.endswith(".gguf") and not os.path.exists(os.path.join(model_dir, "config.json")):
        build_checkpoint(model_dir, "bench", seed=0)
    if args.start_only:
        print(f"{_compile_only(model_dir, sizes):.2f}")
        return 0
    engines = {"eager": _engine(model_dir, True, sizes), "graphs": _engine(model_dir, False, sizes, native=False),
               "compiled": _engine(model_dir, False, sizes)}
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in engines}
    try:
        for mode, (llm, _) in engines.items():
            _round(llm, random.Random(-1), 1)  # warm-up
        for r in range(args.rounds):
            for mode, (llm, _) in engines.items():
                results[mode].append(_round(llm, random.Random(args.seed + r), args.streams))
    finally:
        for llm, _ in engines.values():
            llm.shutdown()
    load = os.getloadavg()[0]
    print(f"\ntorch {torch.__version__}, {os.cpu_count()} CPUs, load average {load:.1f}, median of "
          f"{args.rounds} interleaved rounds; compiled buckets {args.compile_batch_sizes}")
    keys = list(results["eager"][0])
    print(f"{'':<22}{'eager':>12}{'graphs':>12}{'compiled':>12}{'c/eager':>9}{'c/graphs':>9}")
    for key in keys:
        eager, graphs, compiled = (statistics.median(row[key] for row in results[m]) for m in engines)
        print(f"{key:<22}{eager:>12.2f}{graphs:>12.2f}{compiled:>12.2f}{compiled / eager:>9.2f}"
              f"{compiled / graphs:>9.2f}")
    print(f"{'engine start s':<22}" + "".join(f"{seconds:>12.1f}" for _, seconds in engines.values()))
    print("(ITL ms: lower is better; the ratios of that row are of ms)")
    if args.cold_warm:
        cold, warm = _cold_warm(model_dir, args.compile_batch_sizes)
        print(f"compiled start, fresh process: cold cache {cold:.1f} s, warm (on-disk) cache {warm:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
