"""Prefix reuse across chat turns: tiers off, the host KV tier, host + disk, in one run.

Workload (seeded, random token ids, `ignore_eos`): `--conversations`
chats of `--turns` turns. Each turn appends a user message of
~`--user-tokens` tokens to the conversation so far (previous prompt plus its
answer) and generates `--output-tokens` tokens. Every conversation's turn t
is submitted together, then turn t + 1, so by the last turns the prefixes
of all chats (the working set) are far larger than the device KV cache
(`--device-kv-tokens`): with tiers off the device's LRU cycles through them
and most prefixes are recomputed; with the host tier (`--kv-host-bytes`)
evicted blocks spill to host memory and come back on the next turn. The
host + disk rows give the host tier only `--small-host-fraction` of the
working set: alone, it drops most evicted prefixes; with a disk tier
(`--kv-disk-bytes`, files in a temporary directory) the blocks it evicts are
written to disk and read back (the request waits in the loading state while
others step).

Reports, per configuration, the engine's time to first token (arrival to
first token, from the SchedulerStats events) mean / p50 / p99, output
tokens/s over the whole workload, and the prefix-cache hit rate; then the
mean-TTFT ratio. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import torch


def _conversations(args, vocab: int):
    """Every conversation's user messages, U[0.75, 1.25] x --user-tokens long."""
    rng = random.Random(args.seed)

    def user() -> list[int]:
        length = rng.randint(args.user_tokens * 3 // 4, args.user_tokens * 5 // 4)
        return [rng.randrange(4, vocab) for _ in range(length)]

    return [[user() for _ in range(args.turns)] for _ in range(args.conversations)]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _run(model_dir: str, args, messages, **tier) -> dict:
    from trillium import LLM, SamplingParams

    llm = LLM(model_dir, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              num_blocks=args.device_kv_tokens // 16, block_size=16, num_threads=args.executor_threads, **tier)
    ttfts: list[float] = []
    try:
        # NOTE: the engine measures TTFT (scheduler/metrics.py); the offline API has no
        # public hook for the stats stream, so the benchmark listens on its client.
        llm._client.stats_listeners.append(lambda stats: ttfts.extend(stats.ttfts_s))
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2))  # warm-up
        ttfts.clear()
        params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
        contexts = [[] for _ in messages]
        produced = 0
        start = time.perf_counter()
        for turn in range(args.turns):
            prompts = [context + chat[turn] for context, chat in zip(contexts, messages)]
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            for i, output in enumerate(outputs):
                tokens = list(output.outputs[0].token_ids)
                produced += len(tokens)
                contexts[i] = prompts[i] + tokens
        elapsed = time.perf_counter() - start
        stats = llm.get_stats()
        deadline = time.monotonic() + 10
        while len(ttfts) < len(messages) * args.turns and time.monotonic() < deadline:
            time.sleep(0.05)  # the last stats message may still be on its way
    finally:
        llm.shutdown()
    host = stats.kv_tiers[1] if stats.kv_tiers else None
    disk = stats.kv_tiers[2] if len(stats.kv_tiers) > 2 else None
    return {
        "disk_hit_blocks": disk.hit_blocks_total if disk else 0,
        "ttft_mean_s": statistics.fmean(ttfts), "ttft_p50_s": _percentile(ttfts, 0.5),
        "ttft_p99_s": _percentile(ttfts, 0.99), "output_tok_s": produced / elapsed, "elapsed_s": elapsed,
        "hit_rate": stats.prefix_cache_hits_total / max(1, stats.prefix_cache_queries_total),
        "host_hit_blocks": host.hit_blocks_total if host else 0,
        "gib_to_host": stats.kv_bytes_to_host_total / 2**30, "gib_to_device": stats.kv_bytes_to_device_total / 2**30,
        "num_preempted": stats.num_preempted_total, "num_ttfts": len(ttfts),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/prefix_reuse.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--user-tokens", type=int, default=64, help="mean tokens of a user message")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--device-kv-tokens", type=int, default=4096,
                        help="device KV cache size in tokens (the working set should not fit)")
    parser.add_argument("--kv-host-bytes", default="1GiB", help="host tier size")
    parser.add_argument("--small-host-fraction", type=float, default=0.25,
                        help="host tier of the host + disk rows, as a fraction of the working set")
    parser.add_argument("--kv-disk-bytes", default="4GiB", help="disk tier size (a temporary directory)")
    parser.add_argument("--kv-eviction-policy", default="lru", choices=["lru", "arc"])
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--executor-threads", type=int, default=0,
                        help="torch threads of the executor (0: torch's default; 1 is steadier on a busy box)")
    parser.add_argument("--model-dir", default=None, help="where to build the benchmark model (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from trillium.models.synthetic import build_checkpoint

    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), "trillium-bench-model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_checkpoint(model_dir, "bench", seed=0)
    messages = _conversations(args, vocab=8192)
    working_set = sum(sum(len(m) for m in chat) + args.output_tokens * (args.turns - 1) for chat in messages)
    from trillium.config import EngineConfig

    block_bytes = EngineConfig(model=model_dir, num_blocks=2).resolve().kv_block_bytes
    small_host = int(working_set * args.small_host_fraction) // 16 * block_bytes
    policy = args.kv_eviction_policy
    with tempfile.TemporaryDirectory(prefix="trillium-bench-kv-disk-") as disk_dir:
        rows = [
            ("tiers off", _run(model_dir, args, messages)),
            (f"host ({args.kv_host_bytes})",
             _run(model_dir, args, messages, kv_host_bytes=args.kv_host_bytes, kv_eviction_policy=policy)),
            (f"host ({small_host / 2**20:.0f}MiB)",
             _run(model_dir, args, messages, kv_host_bytes=small_host, kv_eviction_policy=policy)),
            (f"host ({small_host / 2**20:.0f}MiB) + disk",
             _run(model_dir, args, messages, kv_host_bytes=small_host, kv_eviction_policy=policy,
                  kv_disk_path=disk_dir, kv_disk_bytes=args.kv_disk_bytes)),
        ]

    print()
    threads = args.executor_threads or torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} executor threads; {args.conversations} conversations x "
          f"{args.turns} turns, ~{args.user_tokens} user + {args.output_tokens} output tokens per turn")
    print(f"device KV cache {args.device_kv_tokens} tokens; last-turn working set {working_set} tokens")
    print(f"{'configuration':<26}{'TTFT mean':>11}{'p50':>9}{'p99':>9}{'out tok/s':>11}{'hit rate':>10}"
          f"{'preempted':>11}{'host hits':>11}{'disk hits':>11}{'GiB->host':>11}{'GiB->dev':>10}")
    for name, r in rows:
        print(f"{name:<26}{r['ttft_mean_s'] * 1e3:>9.0f}ms{r['ttft_p50_s'] * 1e3:>7.0f}ms"
              f"{r['ttft_p99_s'] * 1e3:>7.0f}ms{r['output_tok_s']:>11.1f}{r['hit_rate']:>10.1%}"
              f"{r['num_preempted']:>11}{r['host_hit_blocks']:>11}{r['disk_hit_blocks']:>11}"
              f"{r['gib_to_host']:>11.3f}{r['gib_to_device']:>10.3f}")
    base = rows[0][1]
    for name, r in rows[1:]:
        print(f"mean TTFT vs tiers off: {name} is {base['ttft_mean_s'] / r['ttft_mean_s']:.2f}x faster; "
              f"throughput {r['output_tok_s'] / base['output_tok_s']:.2f}x")
    return 0
