"""HTTP serving benchmark: `trillium serve` under streaming load vs the offline engine.

Workload: the engine-core "mixed" workload (64 requests, prompts U[32,512]
random token ids, outputs U[16,256], ignore_eos), sent as streaming
/v1/completions requests (token-id prompts) at full concurrency and at a
fixed Poisson request rate. Prints request throughput, output tokens/s,
TTFT and inter-token latency (mean, p50, p99) beside the offline
`trillium.LLM` throughput on the same workload, measured in the same run:
`--rounds` offline and full-concurrency runs alternate and the medians are
compared, since a small shared machine drifts between runs. Nothing is
asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import attrs
import httpx
from tqdm import tqdm

from trillium.benchmarks.throughput import _run_trillium, _workload_mixed


@attrs.define
class RequestTiming:
    start: float
    first_token: float | None = None
    chunk_times: list[float] = attrs.field(factory=list)
    end: float = 0.0
    completion_tokens: int = 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _one(session, base_url: str, model: str, prompt: list[int], max_tokens: int) -> RequestTiming:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    timing = RequestTiming(start=time.perf_counter())
    async with session.post(base_url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:  # one SSE line at a time
            line = raw.decode().rstrip("\n")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            # WHY no JSON parse of every chunk: the client shares the 2 cores with the
            # server it measures. A compact chunk says whether it carries text; the
            # usage chunk (and anything else) is parsed.
            if '"usage":null' in line and '"text":"' in line:
                has_text = '"text":""' not in line
            else:
                chunk = json.loads(line[6:])
                has_text = bool(chunk.get("choices") and chunk["choices"][0].get("text"))
                if chunk.get("usage"):
                    timing.completion_tokens = chunk["usage"]["completion_tokens"]
            if has_text:
                if timing.first_token is None:
                    timing.first_token = now
                timing.chunk_times.append(now)
    timing.end = time.perf_counter()
    return timing


async def _drive_async(base_url: str, model: str, reqs, rate: float | None, seed: int):
    import aiohttp

    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=len(reqs) + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        tasks = []
        for prompt, out in reqs:
            tasks.append(asyncio.create_task(_one(session, base_url, model, prompt, out)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        timings = list(await asyncio.gather(*tasks))
        return time.perf_counter() - start, timings


def _drive(base_url: str, model: str, reqs, rate: float | None, seed: int) -> tuple[float, list[RequestTiming]]:
    """Send `reqs` as streaming completions (all at once, or Poisson at `rate`/s).

    WHY aiohttp (as vLLM's benchmark client): its C HTTP parser costs half the
    CPU per streamed chunk of a pure-Python client, and on 2 cores the client
    competes with the server it measures."""
    return asyncio.run(_drive_async(base_url, model, reqs, rate, seed))


def _summary(name: str, elapsed: float, timings: list[RequestTiming]) -> dict:
    ttft = [(t.first_token - t.start) * 1000 for t in timings if t.first_token is not None]
    itl = [
        (b - a) * 1000 for t in timings for a, b in zip(t.chunk_times, t.chunk_times[1:])
    ]
    tokens = sum(t.completion_tokens for t in timings)

    def pct(values: list[float], q: float) -> float:
        return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else float("nan")

    return {
        "name": name, "req_s": len(timings) / elapsed, "tok_s": tokens / elapsed,
        "ttft": (statistics.mean(ttft), statistics.median(ttft), pct(ttft, 99)),
        "itl": (statistics.mean(itl), statistics.median(itl), pct(itl, 99)),
    }


def _wait_healthy(base_url: str, process: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"trillium serve exited with {process.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("server did not become healthy")


def _remote(argv: list[str]) -> bool:
    return any(a.split("=", 1)[0] in ("--base-url", "--label") for a in argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if _remote(argv):
        # WHY a module of its own: against running servers (Trillium, llama-server, vLLM)
        # there is no offline engine to compare with and no server to start.
        from trillium.benchmarks.compare import main as run_compare

        return run_compare(argv)
    parser = argparse.ArgumentParser(prog="trillium bench serving", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="With --base-url URL (or --label NAME=URL) it drives servers that "
                                            "are already running instead: see "
                                            "`trillium bench serving --base-url URL --help`.")
    parser.add_argument("--model-dir", default=None, help="benchmark model dir (default: built in a temp dir)")
    parser.add_argument("--rate", type=float, default=2.0, help="requests/s of the fixed-rate run")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3,
                        help="offline and full-concurrency runs, alternated; medians are reported "
                             "(a shared 2-core box drifts by 10%% between runs)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from trillium import LLM
    from trillium.models.synthetic import build_checkpoint

    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), "trillium-bench-model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_checkpoint(model_dir, "bench", seed=0)

    def workload(offset: int):
        """Its own prompts per run: a repeated prompt would hit the prefix cache."""
        return _workload_mixed(8192, args.seed + offset)[: args.num_requests]

    engine_args = dict(max_num_seqs=64, max_num_batched_tokens=1024, kv_cache_memory="1GiB")

    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "trillium.cli", "serve", "--model", model_dir, "--port", str(port),
           "--served-model-name", "bench", "--max-num-seqs", "64", "--max-num-batched-tokens", "1024",
           "--kv-cache-memory", "1GiB", "--log-level", "warning"]
    server = subprocess.Popen(cmd)
    offline, full = [], []
    try:
        with LLM(model_dir, **engine_args) as llm:
            llm.generate([{"prompt_token_ids": [5, 6, 7]}])
            _wait_healthy(base_url, server)
            # Warm-up: one whole unrecorded run each (the first big run of a process is slower).
            warm_reqs = workload(1000)
            _run_trillium(llm, warm_reqs)
            _drive(base_url, "bench", warm_reqs, None, args.seed)
            # WHY alternated: both sides see the same drift of a shared machine. The
            # idle side (the server, or the offline engine) waits on its queues.
            for round_ in tqdm(range(args.rounds), desc="offline / full concurrency rounds"):
                round_reqs = workload(round_)
                offline.append(_run_trillium(llm, round_reqs))
                elapsed, timings = _drive(base_url, "bench", round_reqs, None, args.seed)
                full.append(_summary("full concurrency", elapsed, timings))
        elapsed, timings = _drive(base_url, "bench", workload(args.rounds), args.rate, args.seed)
        rated = _summary(f"rate {args.rate}/s", elapsed, timings)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    # The round whose ratio is the median stands for the full-concurrency row.
    ratios = [f["tok_s"] / o for o, f in zip(offline, full)]
    median_round = sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]
    offline_tok_s = offline[median_round]
    results = [full[median_round], rated]

    print()
    print("rounds (offline tok/s, full-concurrency tok/s, ratio): "
          + "; ".join(f"{o:.1f}, {f['tok_s']:.1f}, {r:.2f}" for o, f, r in zip(offline, full, ratios)))
    print(f"the round with the median ratio of {len(ratios)}; the rate run once, on its own prompts")
    print(f"offline trillium.LLM: {offline_tok_s:.1f} output tok/s on the same {len(warm_reqs)} requests")
    print(f"{'run':<18}{'req/s':>7}{'tok/s':>8}{'vs offline':>11}"
          f"{'TTFT ms mean/p50/p99':>24}{'ITL ms mean/p50/p99':>23}")
    for r in results:
        ttft = "/".join(f"{v:.0f}" for v in r["ttft"])
        itl = "/".join(f"{v:.1f}" for v in r["itl"])
        print(f"{r['name']:<18}{r['req_s']:>7.2f}{r['tok_s']:>8.1f}{r['tok_s'] / offline_tok_s:>11.2f}"
              f"{ttft:>24}{itl:>23}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
