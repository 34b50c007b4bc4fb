"""Per-step timeline of a real `trillium serve`: where a decode step's time goes.

For each batch size (default 1, 16, 64) it opens that many streaming
/v1/completions requests (token-id prompts, greedy, ignore_eos, long
max_tokens), waits until every stream is decoding, records a *timeline*
profile for `--window-s` seconds (`/start_profile {"timeline": true}`:
spans only, no cProfile or torch.profiler, so the engine runs at its normal
speed), stops it, and cancels the streams. The spans of the executor,
scheduler and detokenizer and the client's SSE chunk arrival times (one
CLOCK_MONOTONIC across processes) become one table: the mean ms per step
of each segment, and its share of the step period (timeline_report.py).

Run: trillium bench timeline [--batches 1,16,64] [--window-s 3]
  or .venv/bin/python bench/step_timeline.py

NOTE: on a shared machine the absolute numbers move from run to run; the
shares of the period move less. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time

from trillium.benchmarks.serving import _free_port, _wait_healthy
from trillium.benchmarks.timeline_report import format_table, load_spans, step_segments, summarize

_MODEL = "bench"


async def _stream(session, base_url: str, prompt: list[int], max_tokens: int, chunks: list[float],
                  started: asyncio.Event, counter: list[int], n: int) -> None:
    body = {"model": _MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    first = True
    async with session.post(base_url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:  # one SSE line at a time
            if not raw.startswith(b"data: {"):
                continue
            chunks.append(time.perf_counter())
            if first:
                first = False
                counter[0] += 1
                if counter[0] == n:
                    started.set()


async def _admin(session, admin_url: str, token: str, path: str, body: dict | None = None) -> dict:
    headers = {"Authorization": f"Bearer {token}"}
    async with session.post(admin_url + path, json=body or {}, headers=headers) as response:
        data = await response.json()
        if response.status != 200:
            raise RuntimeError(f"{path}: {response.status} {data}")
        return data


async def _one_batch(base_url: str, admin_url: str, token: str, batch: int, args) -> tuple[list[str], list[float]]:
    """Run `batch` streams; the timeline files and the chunk times seen while it was recorded."""
    import aiohttp

    chunks: list[float] = []
    started, counter = asyncio.Event(), [0]
    connector = aiohttp.TCPConnector(limit=batch + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as session:
        prompts = [[(7 + 31 * i + j) % 8000 + 3 for j in range(args.prompt_len)] for i in range(batch)]
        tasks = [asyncio.create_task(_stream(session, base_url, p, args.max_tokens, chunks, started, counter, batch))
                 for p in prompts]
        try:
            await asyncio.wait_for(started.wait(), timeout=300)
            await asyncio.sleep(args.warmup_s)
            await _admin(session, admin_url, token, "/start_profile",
                         {"timeline": True, "max_duration_s": args.window_s + 60})
            begin = time.perf_counter()
            await asyncio.sleep(args.window_s)
            stopped = await _admin(session, admin_url, token, "/stop_profile")
            end = time.perf_counter()
            if any(t.done() for t in tasks):
                raise RuntimeError("a stream ended during the window: raise --max-tokens")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return stopped["files"], [t for t in chunks if begin <= t <= end]


def _sync_steps(serve_args: list[str]) -> list[str]:
    """The server's arguments, with synchronous steps unless they name --[no-]async-scheduling. WHY:
    the report matches each step's spans on the assumption that one step is out at a time
    (timeline_report.py), and unset, the flag plans ahead at small batches."""
    if any(a in ("--async-scheduling", "--no-async-scheduling") for a in serve_args):
        return list(serve_args)
    return [*serve_args, "--no-async-scheduling"]


def _server(args, model_dir: str, port: int, admin_port: int, profile_dir: str, token: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trillium.cli", "serve", "--model", model_dir, "--port", str(port),
           "--served-model-name", _MODEL, "--admin-port", str(admin_port), "--profile-dir", profile_dir,
           "--max-num-seqs", str(max(args.batches)), "--kv-cache-memory", args.kv_cache_memory,
           "--log-level", "warning", *_sync_steps(args.serve_arg)]
    # WHY the environment: a token on the command line is visible to every local user.
    return subprocess.Popen(cmd, env={**os.environ, "TRILLIUM_ADMIN_TOKEN": token})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trillium bench timeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=None, help="model dir (default: the `bench` variant, built in a "
                                                          "temp dir)")
    parser.add_argument("--batches", default="1,16,64", help="comma-separated numbers of concurrent streams")
    parser.add_argument("--window-s", type=float, default=3.0, help="seconds recorded per batch size")
    parser.add_argument("--warmup-s", type=float, default=1.0,
                        help="seconds of decoding before the recording starts (every stream has its first token)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per stream")
    parser.add_argument("--max-tokens", type=int, default=2000,
                        help="max_tokens per stream: long enough that none ends in the window")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="the server's --kv-cache-memory")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="one more `trillium serve` argument (repeat: --serve-arg=--dtype --serve-arg=bfloat16)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the summaries as JSON")
    args = parser.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches: expected comma-separated integers, got {args.batches!r}")
    if any(b < 1 for b in args.batches):
        parser.error("--batches: each must be >= 1")

    from trillium.models.synthetic import build_checkpoint

    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), "trillium-bench-model")
    if args.model_dir is None and not os.path.exists(os.path.join(model_dir, "config.json")):
        build_checkpoint(model_dir, "bench", seed=0)  # a given --model-dir (a directory or .gguf) is served as is
    port, admin_port = _free_port(), _free_port()
    results = {}
    with tempfile.TemporaryDirectory(prefix="trillium-timeline-") as profile_dir:
        token = secrets.token_urlsafe(24)
        server = _server(args, model_dir, port, admin_port, profile_dir, token)
        try:
            _wait_healthy(f"http://127.0.0.1:{port}", server)
            for batch in args.batches:
                files, chunks = asyncio.run(_one_batch(
                    f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", token, batch, args))
                results[batch] = summarize(step_segments(load_spans(files), chunks))
                print(f"batch {batch}: {results[batch]['steps']} steps, "
                      f"{results[batch]['period']:.2f} ms per step", file=sys.stderr)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(b): r for b, r in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
