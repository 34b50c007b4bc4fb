"""Engine throughput, side by side with its baselines, in one run.

Workloads (seeded, `ignore_eos`, random prompt token ids):
  mixed         64 requests, prompt lengths U[32, 512], outputs U[16, 256];
                Trillium vs Hugging Face `generate` in static batches of 16
                (left-padded, each batch generating its longest output).
  decode-heavy  32 requests, 128-token prompts, 256 outputs each;
                Trillium vs a bare static-KV-cache decode loop (bare_decode.py).

`--tracing` runs the mixed workload with OTLP tracing off, on and detailed
instead (trillium/benchmarks/tracing.py).

The benchmark model is built deterministically (Llama, hidden 512, 8 layers,
8 heads / 4 KV heads, vocab 8192, float32). Prints a table of output
tokens/s (median of --repeats runs) and ratios. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import torch
from tqdm import tqdm


def _workload_mixed(vocab: int, seed: int):
    rng = random.Random(seed)
    reqs = []
    for _ in range(64):
        p = rng.randint(32, 512)
        o = rng.randint(16, 256)
        reqs.append(([rng.randrange(4, vocab) for _ in range(p)], o))
    return reqs


def _workload_decode(vocab: int, seed: int):
    rng = random.Random(seed + 1)
    return [([rng.randrange(4, vocab) for _ in range(128)], 256) for _ in range(32)]


def _run_trillium(llm, reqs) -> float:
    from trillium import SamplingParams

    return timed_generate(llm, reqs, [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in reqs])


def timed_generate(llm, reqs, params) -> float:
    """Output tokens/s of one `llm.generate` over `reqs` ((prompt ids, output length) pairs)
    with one SamplingParams per request; each must produce exactly its length (ignore_eos)."""
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(o for _, o in reqs), "engine produced the wrong number of tokens"
    return produced / elapsed


def _run_hf(model, reqs, batch_size: int = 16) -> float:
    useful = sum(o for _, o in reqs)
    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        longest = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, (p, _) in enumerate(batch):
            ids[row, longest - len(p):] = torch.tensor(p)
            mask[row, longest - len(p):] = 1
        new = max(o for _, o in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
    return useful / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trillium bench throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (median reported)")
    parser.add_argument("--workloads", default="mixed,decode", help="comma list of mixed, decode")
    parser.add_argument("--model-dir", default=None, help="where to build the benchmark model (default: a temp dir)")
    parser.add_argument("--skip-baselines", action="store_true", help="measure Trillium only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tracing", action="store_true",
                        help="instead: the mixed workload with OTLP tracing off / on / detailed, side by side "
                             "(see trillium/benchmarks/tracing.py)")
    args = parser.parse_args(argv)

    from trillium import LLM
    from trillium.benchmarks.bare_decode import BareLlama
    from trillium.models.synthetic import build_checkpoint

    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), "trillium-bench-model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_checkpoint(model_dir, "bench", seed=0)
    if args.tracing:
        from trillium.benchmarks.tracing import run as run_tracing

        return run_tracing(model_dir, args.repeats, args.seed)
    vocab = 8192
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    rows: list[tuple[str, str, float, str, float]] = []
    llm = LLM(model_dir, max_num_seqs=64, max_num_batched_tokens=1024, kv_cache_memory="1GiB")
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}])  # warm-up
        for workload in workloads:
            make = _workload_mixed if workload == "mixed" else _workload_decode
            # WHY: a fresh seed per repeat, else later repeats hit the prefix cache.
            runs = [make(vocab, args.seed + 1000 * r) for r in range(args.repeats)]
            ours = [_run_trillium(llm, r) for r in tqdm(runs, desc=f"trillium {workload}")]
            base_name, base = "-", []
            if not args.skip_baselines and workload == "mixed":
                from transformers import AutoModelForCausalLM

                hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
                base_name = "HF generate (static batches of 16)"
                base = [_run_hf(hf, r) for r in tqdm(runs, desc="hf mixed")]
                del hf
            elif not args.skip_baselines:
                bare = BareLlama(model_dir)
                base_name = "bare static-cache decode loop (batch 32)"
                base = [bare.decode_throughput(torch.tensor([p for p, _ in r]), r[0][1])[1]
                        for r in tqdm(runs, desc="bare decode")]
            rows.append((workload, "trillium", statistics.median(ours), base_name,
                         statistics.median(base) if base else float("nan")))
    finally:
        llm.shutdown()

    print()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats} runs")
    print(f"{'workload':<14}{'trillium tok/s':>16}{'baseline tok/s':>16}{'ratio':>8}  baseline")
    for workload, _, ours_tps, base_name, base_tps in rows:
        ratio = ours_tps / base_tps if base_tps == base_tps else float("nan")
        print(f"{workload:<14}{ours_tps:>16.1f}{base_tps:>16.1f}{ratio:>8.2f}  {base_name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
