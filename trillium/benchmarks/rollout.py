"""RL rollout benchmark: rollout + weight push cycles against a live `trillium serve`.

One cycle, as an RL framework runs it: `--num-prompts` prompts (U[32,256] random token ids)
each sampled `--n` times (temperature 1, `--max-tokens` new tokens, ignore_eos, so every path
does the same work) with the sampled tokens' logprobs, all requests at once; then a weight push
(`/update_weights_from_disk` of the served checkpoint on the admin port; the engine swaps the
weights between steps). The cycle runs `--iterations` times over SGLang's `/generate`
(`sampling_params.n`, `return_logprob`) and over `/v1/completions` (`n`, `logprobs: 0`), the two
paths alternating on the same server, each cycle with its own prompts of the same lengths (a
repeated prompt would hit the prefix cache). Prints samples/s, output tokens/s and update time
per path (median over the iterations, and each one). Nothing is asserted beyond the answers'
shapes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import attrs

from trillium.benchmarks.serving import _free_port, _wait_healthy

ADMIN_TOKEN = "rollout-bench-admin-token"


@attrs.define
class Cycle:
    path: str
    rollout_s: float
    samples: int
    tokens: int
    update_s: float


def _prompts(lengths: list[int], seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for length in lengths]


async def _one_generate(session, base_url: str, prompt: list[int], n: int, max_tokens: int) -> tuple[int, int]:
    body = {"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "temperature": 1.0, "max_new_tokens": max_tokens, "ignore_eos": True, "n": n}}
    async with session.post(base_url + "/generate", json=body) as response:
        response.raise_for_status()
        outputs = await response.json()
    tokens = 0
    for output in outputs:  # n > 1: a list, one entry per sample
        meta = output["meta_info"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
        tokens += meta["completion_tokens"]
    return len(outputs), tokens


async def _one_completion(session, base_url: str, prompt: list[int], n: int, max_tokens: int) -> tuple[int, int]:
    body = {"model": "bench", "prompt": prompt, "n": n, "temperature": 1.0, "max_tokens": max_tokens,
            "ignore_eos": True, "logprobs": 0}
    async with session.post(base_url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        answer = await response.json()
    for choice in answer["choices"]:
        assert len(choice["logprobs"]["token_logprobs"]) > 0
    return len(answer["choices"]), answer["usage"]["completion_tokens"]


async def _cycle(path: str, base_url: str, admin_url: str, prompts, args) -> Cycle:
    import aiohttp

    one = _one_generate if path == "/generate" else _one_completion
    connector = aiohttp.TCPConnector(limit=len(prompts) + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(session, base_url, p, args.n, args.max_tokens) for p in prompts))
        rollout_s = time.perf_counter() - start
        start = time.perf_counter()
        async with session.post(admin_url + "/update_weights_from_disk", json={"model_path": args.model_dir},
                                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as response:
            response.raise_for_status()
        update_s = time.perf_counter() - start
    return Cycle(path, rollout_s, sum(r[0] for r in results), sum(r[1] for r in results), update_s)


def _report(cycles: list[Cycle]) -> None:
    print(f"{'path':<18}{'samples/s':>10}{'tok/s':>9}{'update s':>10}   per iteration (samples/s, tok/s, update s)")
    for path in ("/generate", "/v1/completions"):
        mine = [c for c in cycles if c.path == path]
        sps = [c.samples / c.rollout_s for c in mine]
        tps = [c.tokens / c.rollout_s for c in mine]
        ups = [c.update_s for c in mine]
        each = "; ".join(f"{s:.2f}, {t:.1f}, {u:.2f}" for s, t, u in zip(sps, tps, ups))
        print(f"{path:<18}{statistics.median(sps):>10.2f}{statistics.median(tps):>9.1f}"
              f"{statistics.median(ups):>10.2f}   {each}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/rollout.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=None, help="benchmark model dir (default: built in a temp dir)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per sample")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from trillium.models.synthetic import build_checkpoint

    args.model_dir = os.path.realpath(args.model_dir or os.path.join(tempfile.gettempdir(), "trillium-bench-model"))
    if not os.path.exists(os.path.join(args.model_dir, "config.json")):
        build_checkpoint(args.model_dir, "bench", seed=0)
    port, admin_port = _free_port(), _free_port()
    base_url, admin_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    cmd = [sys.executable, "-m", "trillium.cli", "serve", "--model", args.model_dir, "--port", str(port),
           "--admin-port", str(admin_port), "--served-model-name", "bench", "--max-num-seqs", "64",
           "--max-num-batched-tokens", "1024", "--kv-cache-memory", "1GiB", "--log-level", "warning"]
    server = subprocess.Popen(cmd, env={**os.environ, "TRILLIUM_ADMIN_TOKEN": ADMIN_TOKEN})
    rng = random.Random(args.seed)
    cycles: list[Cycle] = []
    try:
        _wait_healthy(base_url, server)
        warm = _prompts([rng.randint(32, 256) for _ in range(8)], args.seed + 999, 8192)
        for path in ("/generate", "/v1/completions"):  # unrecorded: the first big run of a process is slower
            asyncio.run(_cycle(path, base_url, admin_url, warm, args))
        for iteration in range(args.iterations):
            lengths = [rng.randint(32, 256) for _ in range(args.num_prompts)]
            # WHY alternated, the order flipped each iteration: both paths see the same drift.
            order = ("/generate", "/v1/completions") if iteration % 2 == 0 else ("/v1/completions", "/generate")
            for k, path in enumerate(order):
                prompts = _prompts(lengths, args.seed + 10 * iteration + k, 8192)
                cycles.append(asyncio.run(_cycle(path, base_url, admin_url, prompts, args)))
                print(f"iteration {iteration} {path}: {cycles[-1]}", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    print()
    print(f"{args.num_prompts} prompts x n={args.n}, {args.max_tokens} new tokens each, then a disk weight push; "
          f"{args.iterations} iterations per path, medians")
    _report(cycles)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
