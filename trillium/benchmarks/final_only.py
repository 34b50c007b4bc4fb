"""Unstreamed requests against an earlier revision, both served at once (`bench/final_only.py`).

A request whose response is sent whole (`stream: false`, trillium.LLM) is final-only
(SamplingParams.final_only): the scheduler sends its first token, then its tokens in
chunks of 50, so the detokenizer and the api handle one message per 50 tokens instead of
one per token (README "Unstreamed requests"). This measures what that saves, against a
revision from before it (--against REV, e.g. the commit before the change): that
revision's `trillium` package is exported with `git archive` to a temporary directory
and served from there with this checkout's virtual environment, beside this checkout's
server, both with the same flags (--server-arg, repeatable) on the float32 `bench`
model. One client sends the same non-streamed requests (prompt --input-len random
token ids, --output-len tokens, greedy, EOS ignored) to each server in turn, the order
flipped each request, so a change in the machine's speed meets both alike; with
--concurrency C, C requests at once per turn. Per server: output tok/s (median and
range over --rounds) and the ratio. With --stream, streamed requests as well (a
control: streamed requests are paced as before). Nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from trillium.benchmarks.cpu_peers import _running, _trillium_spec, _vocab, add_trillium_server_args
from trillium.benchmarks.openai_client import run_workload, summarize
from trillium.benchmarks.compare import build_workload


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/final_only.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", required=True, metavar="REV",
                   help="the git revision served as the baseline (e.g. the commit before final-only outputs)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="a flag for both servers (repeatable; e.g. --server-arg=--num-scheduler-steps=16)")
    p.add_argument("--rounds", type=int, default=4, help="rounds (default 4)")
    p.add_argument("--requests", type=int, default=6, help="requests per round and server (default 6)")
    p.add_argument("--concurrency", type=int, default=1, help="requests at once per turn (default 1)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--stream", action="store_true", help="also streamed requests (a control)")
    add_trillium_server_args(p)
    return p.parse_args(argv)


def _export(rev: str, into: Path) -> str:
    """REV's tree (`git archive`) under `into`; returns its commit."""
    root = Path(__file__).resolve().parents[2]
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=root, check=True,
                            capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", commit, "trillium"], cwd=root, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return commit


async def _post(url: str, prompt: list[int], max_tokens: int) -> int:
    """One unstreamed /v1/completions request (openai_client's requests all stream); its completion tokens."""
    import aiohttp

    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": False}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"{url}: {response.status} {await response.text()}")
            return (await response.json())["usage"]["completion_tokens"]


async def _turn(url: str, batch, stream: bool) -> tuple[float, int]:
    """`batch` at once: (seconds, completion tokens)."""
    if stream:
        elapsed, timings = await run_workload(url, "/v1/completions", "bench", batch)
        return elapsed, summarize(elapsed, timings)["completion_tokens"]
    start = time.perf_counter()
    got = await asyncio.gather(*(_post(url, prompt, out) for prompt, out in batch))
    return time.perf_counter() - start, sum(got)


async def _measure(urls: dict[str, str], args: argparse.Namespace, vocab: int, stream: bool) -> dict[str, list]:
    shape = argparse.Namespace(workload="fixed", random_input_len=args.input_len, random_output_len=args.output_len,
                               num_prompts=args.requests * args.concurrency)
    for url in urls.values():  # warm-up
        await _turn(url, [(p, 16) for p, _ in build_workload(shape, vocab, 10_000)[:1]], stream)
    rates: dict[str, list[float]] = {label: [] for label in urls}
    turn = 0
    for round_ in range(args.rounds):
        reqs = build_workload(shape, vocab, args.seed + round_)
        spent = {label: [0.0, 0] for label in urls}
        for i in range(0, len(reqs), args.concurrency):
            batch = reqs[i: i + args.concurrency]
            for label in (list(urls) if turn % 2 == 0 else list(urls)[::-1]):
                elapsed, tokens = await _turn(urls[label], batch, stream)
                spent[label][0] += elapsed
                spent[label][1] += tokens
            turn += 1
        for label, (elapsed, tokens) in spent.items():
            rates[label].append(tokens / elapsed)
        print(f"  {'streamed' if stream else 'unstreamed'} round {round_ + 1}/{args.rounds}: "
              + ", ".join(f"{label} {rates[label][-1]:.1f} tok/s" for label in urls), flush=True)
    return rates


def main(argv: list[str] | None = None) -> int:
    from trillium.models.synthetic import build_checkpoint

    args = _parse(argv)
    args.trillium_arg = args.server_arg
    args.work_dir = str(Path(args.work_dir).resolve())  # WHY: the baseline server runs in another directory
    model = Path(args.work_dir) / "bench-model"
    if not (model / "config.json").exists():
        build_checkpoint(str(model), "bench", seed=0)
    vocab = _vocab(model)
    with tempfile.TemporaryDirectory(prefix="trillium-rev-") as tree, contextlib.ExitStack() as stack:
        commit = _export(args.against, Path(tree))
        new = _trillium_spec(args, model, "bench", ("single",))
        new.name = "final-only this checkout"
        old = _trillium_spec(args, model, "bench", ("single",))  # the same flags (--server-arg)
        old.name = f"final-only at {commit[:10]}"
        # WHY cwd and PYTHONPATH: `python -m trillium.cli` then imports the exported tree's package
        old.env = {"PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")}
        old.cmd = ["/usr/bin/env", f"--chdir={tree}", *old.cmd]
        urls = {}
        for label, spec in (("this checkout", new), (commit[:10], old)):
            print(f"{spec.name}: starting ({' '.join(spec.cmd)})", flush=True)
            urls[label] = stack.enter_context(_running(spec, args))
        results = {"unstreamed": asyncio.run(_measure(urls, args, vocab, stream=False))}
        if args.stream:
            results["streamed"] = asyncio.run(_measure(urls, args, vocab, stream=True))
    flags = " ".join(args.server_arg) or "(defaults)"
    print(f"\n{args.rounds} rounds x {args.requests} turns of {args.concurrency} request(s), prompt "
          f"{args.input_len}, {args.output_len} out, bench model, {args.threads} threads, flags {flags}; "
          f"python {sys.version.split()[0]}")
    print(f"{'requests':<12}{'server':<16}{'tok/s median':>13}{'range':>16}{'ratio':>8}")
    for kind, rates in results.items():
        base = statistics.median(rates[commit[:10]])
        for label, got in rates.items():
            median = statistics.median(got)
            print(f"{kind:<12}{label:<16}{median:>13.1f}{f'{min(got):.1f}-{max(got):.1f}':>16}"
                  f"{median / base:>7.2f}x")
    return 0
