"""`trillium bench serving --base-url URL [...]`: one client, the same workload, several servers.

Drives any OpenAI-compatible server (Trillium, llama.cpp's llama-server,
vLLM, ...) already running at each `--base-url` (or `--label NAME=URL`)
instead of starting its own `trillium serve`; flag names follow vLLM's
`vllm bench serve` (vllm/benchmarks/serve.py) where they apply.

Workloads (seeded, greedy, `ignore_eos`, random prompt token ids, as
trillium/benchmarks/throughput.py builds them):
  mixed   Trillium's own mixed workload: prompts U[32, 512], outputs U[16, 256]
          (the first 64 requests are those of `trillium bench throughput`).
  fixed   every prompt --random-input-len ids, every output --random-output-len.
Prompts go as token-id lists (vLLM and llama-server accept them on
/v1/completions); `--text-prompts` decodes them with `--tokenizer` first for
servers that take only text (their lengths then change on re-tokenizing).

Each round sends fresh prompts to every server in turn (the same prompts to
each, so a shared machine's drift hits all alike); a server's row is its
round with the median tok/s. Prints one table with a row per server
(req/s, output tok/s, TTFT and ITL mean/p50/p99); `--save-result` writes
every round as JSON, `--plot FILE.png` a throughput/latency chart
(needs matplotlib). OPENAI_API_KEY, when set, is sent as the bearer token
(as vLLM's client does). A server that is down or answers an error: a
message and exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import sys
import time

from trillium.benchmarks.openai_client import BenchError, first_model_id, run_workload, summarize
from trillium.benchmarks.throughput import _workload_mixed

BENCH_VOCAB = 8192  # the `bench` model's vocabulary (trillium build-model --variant bench)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="trillium bench serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", action="append", default=[], metavar="URL",
                   help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (repeat for several; "
                        "each gets a row, labelled by its URL)")
    p.add_argument("--label", action="append", default=[], metavar="NAME=URL",
                   help="a server with a row label, e.g. llama.cpp=http://127.0.0.1:8080 (repeatable)")
    p.add_argument("--model", default=None,
                   help="the served model name sent as `model` (default: each server's first GET /v1/models id)")
    p.add_argument("--endpoint", default="/v1/completions",
                   help="completions path on each server (default /v1/completions; chat is not supported)")
    p.add_argument("--workload", choices=["mixed", "fixed"], default="mixed",
                   help="mixed: Trillium's mixed workload (prompts 32-512, outputs 16-256); "
                        "fixed: --random-input-len / --random-output-len for every request")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per round (default 64)")
    p.add_argument("--random-input-len", type=int, default=128, help="prompt token ids per request (fixed)")
    p.add_argument("--random-output-len", type=int, default=128, help="max_tokens per request (fixed)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"prompt ids are drawn from [4, vocab) (default: --tokenizer's size, else {BENCH_VOCAB}, "
                        "the bench model's)")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir or GGUF file (for --text-prompts / vocab)")
    p.add_argument("--text-prompts", action="store_true",
                   help="send prompts as text decoded with --tokenizer, for servers that take no token ids")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--rounds", type=int, default=1, help="rounds of fresh prompts; each row is its median round")
    p.add_argument("--num-warmups", type=int, default=1,
                   help="unrecorded warm-up requests per server before the rounds (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request before giving up (default 600)")
    p.add_argument("--save-result", nargs="?", const="", default=None, metavar="FILE.json",
                   help="write every round's numbers as JSON (to FILE.json, --result-filename, "
                        "or trillium-bench-serving-<time>.json)")
    p.add_argument("--result-filename", default=None, help="the --save-result file name (vLLM's spelling)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write a throughput / latency chart per server (needs matplotlib)")
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every misuse is an argparse error (exit 2) before any request is sent."""
    if not args.base_url and not args.label:
        p.error("give at least one --base-url URL or --label NAME=URL")
    for item in args.label:
        name, sep, url = item.partition("=")
        if not sep or not name or not url:
            p.error(f"--label {item!r}: expected NAME=URL")
    if not args.endpoint.startswith("/") or not args.endpoint.endswith("/completions") \
            or args.endpoint.endswith("/chat/completions"):
        p.error(f"--endpoint {args.endpoint!r}: only a /v1/completions-style path is supported")
    if args.text_prompts and not args.tokenizer:
        p.error("--text-prompts needs --tokenizer to decode the token ids")
    for name in ("num_prompts", "random_input_len", "random_output_len", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.num_warmups < 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        p.error("--num-warmups must be >= 0 and --max-concurrency >= 1")
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0 (inf: all at once)")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs the matplotlib package, which is not installed in this environment "
                f"({sys.executable}); install it (pip install matplotlib) or drop --plot")


def _servers(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(label, base URL) per server, in the order given (--base-url ones first)."""
    pairs = [(url.rstrip("/"), url.rstrip("/")) for url in args.base_url]
    pairs += [(name, url.rstrip("/")) for name, _, url in (item.partition("=") for item in args.label)]
    return pairs


def build_workload(args: argparse.Namespace, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request; `seed` picks the round's own prompts."""
    if args.workload == "fixed":
        import random

        rng = random.Random(seed)
        return [([rng.randrange(4, vocab) for _ in range(args.random_input_len)], args.random_output_len)
                for _ in range(args.num_prompts)]
    reqs: list[tuple[list[int], int]] = []
    part = 0
    while len(reqs) < args.num_prompts:  # _workload_mixed makes 64 per seed
        reqs += _workload_mixed(vocab, seed + 100_003 * part)
        part += 1
    return reqs[: args.num_prompts]


def _prompt_encoder(args: argparse.Namespace):
    """(vocab size, ids -> what is sent as `prompt`)."""
    tokenizer = None
    if args.tokenizer:
        from trillium.models.tokenizer import load_tokenizer

        try:
            tokenizer = load_tokenizer(args.tokenizer)
        except Exception as e:  # noqa: BLE001 -- any load failure is a user-facing message
            raise BenchError(f"cannot load --tokenizer {args.tokenizer}: {e}") from e
    vocab = args.vocab_size or (tokenizer.vocab_size if tokenizer else BENCH_VOCAB)
    if vocab <= 4:
        raise BenchError(f"vocab size {vocab} leaves no prompt ids (they are drawn from [4, vocab))")
    if args.text_prompts:
        return vocab, lambda ids: tokenizer.decode(ids)
    return vocab, lambda ids: ids


async def _bench_all(args: argparse.Namespace) -> list[dict]:
    vocab, encode = _prompt_encoder(args)
    servers = []
    urls = [url for _, url in _servers(args)]
    for url in sorted({u for u in urls if urls.count(u) > 1}):
        print(f"warning: {url} is listed more than once: its later rows are served from its prefix cache",
              file=sys.stderr)
    for label, url in _servers(args):
        servers.append({"label": label, "base_url": url,
                        "model": args.model or await first_model_id(url), "rounds": []})
    opts = dict(request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed,
                timeout_s=args.timeout)
    if args.num_warmups:
        warm = [(encode(p), o) for p, o in build_workload(args, vocab, args.seed + 1000)[: args.num_warmups]]
        for s in servers:
            await run_workload(s["base_url"], args.endpoint, s["model"], warm, **opts)
    for round_ in range(args.rounds):
        reqs = [(encode(p), o) for p, o in build_workload(args, vocab, args.seed + round_)]
        for s in servers:
            print(f"round {round_ + 1}/{args.rounds}: {s['label']} ({len(reqs)} requests)", file=sys.stderr)
            elapsed, timings = await run_workload(s["base_url"], args.endpoint, s["model"], reqs, **opts)
            s["rounds"].append(summarize(elapsed, timings))
    for s in servers:
        ordered = sorted(s["rounds"], key=lambda r: r["tok_s"])
        s["median"] = ordered[len(ordered) // 2]
    return servers


def format_table(servers: list[dict]) -> str:
    """One row per server: its median round; `vs first` is tok/s over the first server's."""
    width = max(len("server"), *(len(s["label"]) for s in servers)) + 2
    lines = [f"{'server':<{width}}{'req/s':>8}{'tok/s':>9}{'vs first':>9}"
             f"{'TTFT ms mean/p50/p99':>24}{'ITL ms mean/p50/p99':>23}"]
    first = servers[0]["median"]["tok_s"]
    for s in servers:
        m = s["median"]
        ttft = "/".join(f"{m[f'ttft_ms_{k}']:.0f}" for k in ("mean", "p50", "p99"))
        itl = "/".join(f"{m[f'itl_ms_{k}']:.1f}" for k in ("mean", "p50", "p99"))
        ratio = m["tok_s"] / first if first else float("nan")
        lines.append(f"{s['label']:<{width}}{m['req_s']:>8.2f}{m['tok_s']:>9.1f}{ratio:>9.2f}{ttft:>24}{itl:>23}")
    return "\n".join(lines)


def _plot(servers: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # NOTE: files only, no display
    import matplotlib.pyplot as plt

    labels = [s["label"] for s in servers]
    fig, (ax_tps, ax_lat) = plt.subplots(1, 2, figsize=(11, 4))
    ax_tps.bar(labels, [s["median"]["tok_s"] for s in servers])
    ax_tps.set_ylabel("output tokens/s")
    ax_tps.set_title("throughput")
    xs = range(len(servers))
    for offset, key in ((-0.3, "ttft_ms_p50"), (-0.1, "ttft_ms_p99"), (0.1, "itl_ms_p50"), (0.3, "itl_ms_p99")):
        ax_lat.bar([x + offset for x in xs], [s["median"][key] for s in servers], width=0.2, label=key)
    ax_lat.set_xticks(list(xs), labels)
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("ms (log)")
    ax_lat.set_title("latency")
    ax_lat.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _json_safe(value):
    """nan (no ITL with one-token outputs, say) becomes null: strict JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        servers = asyncio.run(_bench_all(args))
    except BenchError as e:
        print(f"trillium bench serving: error: {e}", file=sys.stderr)
        return 1
    print(format_table(servers))
    for s in servers:
        m = s["median"]
        if m["completion_tokens"] != m["expected_completion_tokens"]:
            print(f"warning: {s['label']} produced {m['completion_tokens']} tokens where "
                  f"{m['expected_completion_tokens']} were asked with ignore_eos (does it honour ignore_eos?)",
                  file=sys.stderr)
    if args.save_result is not None:
        path = args.save_result or args.result_filename or time.strftime("trillium-bench-serving-%Y%m%d-%H%M%S.json")
        config = {k: v for k, v in vars(args).items() if k not in ("save_result", "result_filename", "plot")}
        with open(path, "w") as f:
            json.dump(_json_safe({"config": config, "servers": servers}), f, indent=2)
        print(f"results written to {path}")
    if args.plot:
        _plot(servers, args.plot)
        print(f"chart written to {args.plot}")
    return 0
