"""How much one request with many stop strings slows everyone else (ISSUE 16).

Run: PYTHONPATH=. .venv/bin/python bench/stop_string_stall.py [--model PATH] [--num-stops 10000] [--n 4]
     [--serve-arg=--max-stop-strings=10000 ...]

Starts `trillium serve` (the tree on PYTHONPATH) on a loopback port, with a
small synthetic Llama checkpoint unless --model is given. Then:

  1. alone: a 16-token completion (greedy, ignore_eos), median of --repeats;
  2. loaded: a streamed request with --num-stops stop strings (that never
     match) and n=--n, --big-max-tokens long, is started; once its first
     chunk arrived, the same 16-token completion is timed again while the
     big one keeps streaming.

Prints both latencies (seconds) and their ratio. Results are printed, never
asserted; a shared CPU box makes them noisy, so compare runs side by side.
A server that refuses the big request (a cap) says so and stops.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import httpx

from trillium.models.synthetic import build_checkpoint


def _small(http: httpx.Client, max_tokens: int) -> float:
    start = time.perf_counter()
    response = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True})
    response.raise_for_status()
    return time.perf_counter() - start


def _big(base_url: str, body: dict, started: threading.Event, done: threading.Event, errors: list) -> None:
    try:
        with httpx.Client(base_url=base_url, timeout=600) as http:
            with http.stream("POST", "/v1/completions", json=body) as stream:
                if stream.status_code != 200:
                    errors.append(f"{stream.status_code}: {stream.read().decode()[:300]}")
                    return
                for line in stream.iter_lines():
                    if line.startswith("data: "):
                        started.set()
    except Exception as exc:  # printed by the main thread
        errors.append(repr(exc))
    finally:
        started.set()
        done.set()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-stops", type=int, default=10_000)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--small-max-tokens", type=int, default=16)
    parser.add_argument("--big-max-tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `trillium serve` argument")
    args = parser.parse_args()

    import sys
    sys.path.insert(0, "tests")
    from support.serve_process import ServeProcess

    model = args.model or str(build_checkpoint(tempfile.mkdtemp(prefix="stop-bench-"), "llama",
                                               max_position_embeddings=2048))
    server = ServeProcess(model, "--executor-threads", "1", "--kv-cache-memory", "64MiB", *args.serve_arg)
    try:
        server.wait_healthy(timeout_s=900)
        with httpx.Client(base_url=server.base_url, timeout=600) as http:
            _small(http, args.small_max_tokens)  # warm-up
            alone = statistics.median(_small(http, args.small_max_tokens) for _ in range(args.repeats))
            stops = [f"\x01never-{i:06d}\x02" for i in range(args.num_stops)]
            body = {"prompt": "Once upon a time", "max_tokens": args.big_max_tokens, "n": args.n, "stop": stops,
                    "temperature": 1.0, "seed": 0, "ignore_eos": True, "stream": True}
            started, done, errors = threading.Event(), threading.Event(), []
            threading.Thread(target=_big, args=(server.base_url, body, started, done, errors), daemon=True).start()
            started.wait(600)
            if errors:
                print(f"the big request was refused: {errors[0]}")
                return 1
            loaded = [_small(http, args.small_max_tokens) for _ in range(args.repeats)]
            still_running = not done.is_set()
            done.wait(600)
    finally:
        server.stop()
    print(f"{args.small_max_tokens}-token completion alone: {alone:.3f} s (median of {args.repeats})")
    print(f"... next to {args.num_stops} stop strings x n={args.n}: {statistics.median(loaded):.3f} s "
          f"(median; runs {', '.join(f'{x:.3f}' for x in loaded)}; big request still streaming at the end: "
          f"{still_running})")
    print(f"slowdown: {statistics.median(loaded) / alone:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
