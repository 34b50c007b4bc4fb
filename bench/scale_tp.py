"""Tensor parallelism on this machine: the per-step fan-out cost, and TP=1 vs TP=2 decode throughput.

Run: .venv/bin/python bench/scale_tp.py [--model PATH] [--num-prompts 8] [--max-tokens 32]
                                       [--batch 32] [--fanout-steps 500] [--skip-throughput]

1. Fan-out (`actors/executor/tp_fanout.py`): two processes join a real
   `TpGroup` (gloo on loopback); rank 0 encodes a decode `ExecuteBatch` of
   --batch requests with the engine codec and broadcasts it with the
   previous step's tokens, rank 1 receives and decodes it, --fanout-steps
   times. Printed: the payload bytes, rank 0's encode + send time per step
   and rank 1's per-step time from its first receive to its last decode
   (what a step costs the follower beyond its own forward).
2. Throughput: `trillium.LLM` with tensor_parallel_size 1 (all cores, then
   half of them: what one rank of two gets) and 2 on the same
   checkpoint (default: the synthetic "bench" model, hidden 512, 8 layers,
   8/4 heads, vocab 8192), --num-prompts greedy prompts of --max-tokens
   tokens each, all in one batch: decode tokens/s and the time per step,
   side by side with the fan-out cost.

NOTE: on a 2-core CPU, TP=2 gives each rank one core and adds an all-reduce
per layer (twice) and a gather per step: it cannot win; the table is the
record. The numbers are wall time on a shared, loaded machine: compare the
rows of one run, not runs of different days.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


def _decode_batch(batch: int):
    from trillium.actors.protocol.execute import CachedRequests, ExecuteBatch

    return ExecuteBatch(
        step_id=1234, new_requests=(),
        cached=CachedRequests(
            request_ids=tuple(f"cmpl-{i:08x}-0" for i in range(batch)),
            num_computed_tokens=np.arange(100, 100 + batch, dtype=np.int32),
            new_block_ids=np.arange(batch // 4, dtype=np.int32),
            new_block_offsets=np.minimum(np.arange(batch + 1, dtype=np.int32), batch // 4).astype(np.int32),
        ),
        num_scheduled_tokens=np.ones(batch, np.int32),
    )


def fanout_rank(rank: int, port: int, batch: int, steps: int) -> dict:
    """One rank of the fan-out measurement (run in its own process)."""
    import torch

    from trillium.actors.assembly import engine_codec
    from trillium.actors.executor.tp_fanout import pack, unpack
    from trillium.distributed.tp_group import TpGroup

    torch.set_num_threads(1)
    group = TpGroup.join(rank, 2, port, torch.device("cpu"), 60.0)
    codec = engine_codec()
    message = _decode_batch(batch)
    tokens = np.arange(batch, dtype=np.int32)
    group.barrier()
    times, size = [], 0
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        if rank == 0:
            payload = pack(tokens, codec.encode(message))
            size = len(payload)
            group.broadcast_bytes(payload)
        else:
            got, frames = unpack(group.broadcast_bytes(None))
            codec.decode(frames)
        times.append(time.perf_counter() - t0)
    total = time.perf_counter() - start
    group.barrier()
    group.close()
    return {"rank": rank, "bytes": size, "mean_us": 1e6 * total / steps,
            "p50_us": 1e6 * statistics.median(times)}


def measure_fanout(batch: int, steps: int) -> list[dict]:
    from trillium.actors.assembly import free_loopback_port

    port = free_loopback_port()
    cmd = [sys.executable, __file__, "--fanout-rank", "{rank}", "--port", str(port), "--batch", str(batch),
           "--fanout-steps", str(steps)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_root(), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([c.replace("{rank}", str(r)) for c in cmd], stdout=subprocess.PIPE, env=env)
             for r in (0, 1)]
    return [json.loads(p.communicate(timeout=600)[0].decode().strip().splitlines()[-1]) for p in procs]


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure_throughput(model: str, size: int, threads: int, num_prompts: int, max_tokens: int) -> dict:
    from trillium import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(16)]} for i in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model, dtype="float32", kv_cache_memory="64MiB", max_num_seqs=max(num_prompts, 1),
             tensor_parallel_size=size, num_threads=threads) as llm:
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm up
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    label = threads or (f"{os.cpu_count() // size}/rank" if size > 1 else os.cpu_count())
    return {"tp": size, "threads": label, "tokens": tokens,
            "wall_s": wall, "tok_s": tokens / wall, "step_ms": 1e3 * wall / max_tokens,
            "first": outs[0].outputs[0].token_ids[:8]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the synthetic 'bench' checkpoint, built here")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32, help="requests in the fanned-out decode step")
    parser.add_argument("--fanout-steps", type=int, default=500)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--fanout-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fanout_rank is not None:
        print(json.dumps(fanout_rank(args.fanout_rank, args.port, args.batch, args.fanout_steps)), flush=True)
        return 0
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (shared: wall times are noisy)")
    ranks = measure_fanout(args.batch, args.fanout_steps)
    print(f"\nstep fan-out (broadcast from rank 0 over gloo), decode batch of {args.batch}, "
          f"{ranks[0]['bytes']} bytes, {args.fanout_steps} steps:")
    print(f"  rank 0 encode + send   mean {ranks[0]['mean_us']:8.1f} us   p50 {ranks[0]['p50_us']:8.1f} us")
    print(f"  rank 1 receive + decode mean {ranks[1]['mean_us']:8.1f} us   p50 {ranks[1]['p50_us']:8.1f} us")
    if args.skip_throughput:
        return 0
    model = args.model
    if model is None:
        from trillium.models.synthetic import build_checkpoint

        model = str(build_checkpoint(tempfile.mkdtemp(prefix="trillium-bench-tp-"), "bench"))
    # WHY a one-rank row with half the cores too: TP=2 gives each rank cores / 2 threads.
    half = max(1, (os.cpu_count() or 2) // 2)
    rows = [measure_throughput(model, size, threads, args.num_prompts, args.max_tokens)
            for size, threads in ((1, 0), (1, half), (2, 0))]
    print(f"\ndecode, {args.num_prompts} prompts x {args.max_tokens} tokens, one batch:")
    print(f"  {'tp':>3} {'threads':>9} {'tokens/s':>10} {'ms/step':>9} {'fan-out us/step':>16}  same greedy tokens")
    for row in rows:
        fan = "-" if row["tp"] == 1 else f"{ranks[1]['mean_us']:.0f}"
        print(f"  {row['tp']:>3} {str(row['threads']):>9} {row['tok_s']:>10.1f} {row['step_ms']:>9.1f} {fan:>16}  "
              f"{row['first'] == rows[0]['first']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
