"""--stream-interval and --num-scheduler-steps, one server at a time (`bench/stream_interval.py`).

How often a streamed response gets a chunk decides how many messages go through
the scheduler, the detokenizer and the api; on a small CPU each costs the
forward's cores ~1.8 ms (README "Streaming a step's tokens"). This starts one
`trillium serve` per flag set (--config LABEL=FLAGS, repeatable; default: the
README's table) on the float32 `bench` model, and runs `bench/cpu_peers.py`'s
workloads with its client: one stream (--single-requests one after another,
prompt 128, 128 out) and, with --all-at-once, its mixed requests all at once.
The flag sets are alternated over --passes passes (each server started once per
pass), so a machine that speeds up or slows down meets every set alike. Per
set: tok/s (median and range over every round of every pass), ITL p50 (the
gap between chunks that carry text, as cpu_peers computes it) and text chunks
per request. Nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

from trillium.benchmarks import cpu_peers_report as report
from trillium.benchmarks.cpu_peers import _round_requests, _running, _trillium_spec, _vocab, add_trillium_server_args
from trillium.benchmarks.openai_client import run_workload, summarize

DEFAULT_CONFIGS = (
    "default=",
    "interval 8=--stream-interval 8",
    "K 16, interval 16=--num-scheduler-steps 16 --stream-interval 16",
    "K 16=--num-scheduler-steps 16",
    "K 16, interval 4=--num-scheduler-steps 16 --stream-interval 4",
    "K 16, interval 8=--num-scheduler-steps 16 --stream-interval 8",
)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", metavar="LABEL=FLAGS",
                   help="a flag set to serve with (repeatable; default: " + "; ".join(DEFAULT_CONFIGS) + ")")
    p.add_argument("--passes", type=int, default=2, help="passes over the flag sets (default 2)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of fresh prompts per workload and pass (default 2)")
    p.add_argument("--single-requests", type=int, default=4, help="one-stream requests per round (default 4)")
    p.add_argument("--all-at-once", action="store_true", help="also the mixed requests all at once (64)")
    add_trillium_server_args(p)
    args = p.parse_args(argv)
    # The fields cpu_peers's request builder reads.
    args.input_len, args.output_len, args.num_prompts, args.cap_output_len = 128, 128, 64, 0
    args.configs = [c.partition("=") for c in (args.config or DEFAULT_CONFIGS)]
    if any(not sep for _, sep, _ in args.configs):
        p.error("--config takes LABEL=FLAGS")
    return args


async def _serve_rounds(url: str, args: argparse.Namespace, vocab: int, pass_: int) -> dict[str, list[dict]]:
    warm = _round_requests(args, report.WORKLOADS[0], vocab, 1000)[:1]
    await run_workload(url, "/v1/completions", "bench", [(p, 16) for p, _ in warm])
    out: dict[str, list[dict]] = {}
    for workload in (w for w in report.WORKLOADS if w.key == "single" or (w.key == "all64" and args.all_at_once)):
        for round_ in range(args.rounds):
            reqs = _round_requests(args, workload, vocab, pass_ * args.rounds + round_)
            elapsed, timings = await run_workload(url, "/v1/completions", "bench", reqs,
                                                  max_concurrency=1 if workload.key == "single" else None)
            figures = summarize(elapsed, timings)
            figures["text_chunks"] = sum(len(t.chunk_times) for t in timings) / len(timings)
            out.setdefault(workload.key, []).append(figures)
    return out


def main(argv: list[str] | None = None) -> int:
    from trillium.models.synthetic import build_checkpoint

    args = _parse(argv)
    model = Path(args.work_dir) / "bench-model"
    if not (model / "config.json").exists():
        build_checkpoint(str(model), "bench", seed=0)
    vocab = _vocab(model)
    results: dict[str, dict[str, list[dict]]] = {label: {} for label, _, _ in args.configs}
    for pass_ in range(args.passes):
        order = args.configs if pass_ % 2 == 0 else args.configs[::-1]
        for label, _, flags in order:
            args.trillium_arg = flags.split()
            spec = _trillium_spec(args, model, "bench", ("single",))
            spec.name = f"stream-interval {label}"  # its log file's name
            with _running(spec, args) as url:
                got = asyncio.run(_serve_rounds(url, args, vocab, pass_))
            for key, rounds in got.items():
                results[label].setdefault(key, []).extend(rounds)
                print(f"  pass {pass_ + 1} {label} {key}: " + ", ".join(f"{r['tok_s']:.1f}" for r in rounds)
                      + " tok/s", flush=True)
    print(f"\n{args.passes} passes x {args.rounds} rounds, bench model, {args.threads} threads")
    print(f"{'flags':<52}{'workload':<9}{'tok/s median':>13}{'range':>16}{'ITL p50 ms':>12}{'text chunks':>12}")
    for label, _, flags in args.configs:
        for key, rounds in results[label].items():
            tok_s = [r["tok_s"] for r in rounds]
            itl = statistics.median(r["itl_ms_p50"] for r in rounds)
            chunks = statistics.mean(r["text_chunks"] for r in rounds)
            print(f"{(flags or '(defaults)'):<52}{key:<9}{statistics.median(tok_s):>13.1f}"
                  f"{f'{min(tok_s):.1f}-{max(tok_s):.1f}':>16}{itl:>12.1f}{chunks:>12.1f}")
    return 0
