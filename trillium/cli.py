"""The `trillium` command line.

    trillium generate --model PATH "prompt" ...   offline generation (the real engine, in-process)
    trillium bench throughput [...]               engine throughput vs Hugging Face / a bare decode loop
    trillium build-model --variant bench PATH     write a small deterministic test checkpoint
"""

from __future__ import annotations

import argparse
import logging
import sys


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    from trillium.config import DEFAULT_KV_CACHE_MEMORY

    group = parser.add_argument_group("engine")
    group.add_argument("--model", required=True, help="Hugging Face model directory or .gguf file")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="weight and activation dtype (auto: float32 on CPU, bf16/fp16 on CUDA)")
    group.add_argument("--device", default="cpu", help="torch device for the executor (cpu, cuda, cuda:1)")
    group.add_argument("--max-model-len", type=int, default=0,
                       help="context length limit (default: the model's max_position_embeddings)")
    group.add_argument("--max-num-seqs", type=int, default=64, help="most requests in one batch")
    group.add_argument("--max-num-batched-tokens", type=int, default=1024,
                       help="token budget of one engine step (long prompts are prefilled in chunks)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    group.add_argument("--kv-cache-memory", default=DEFAULT_KV_CACHE_MEMORY,
                       help="KV cache size: bytes (e.g. 512MiB, 2GB) or a percentage of device memory")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse KV blocks of shared prompt prefixes")
    group.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                       help="order of admission: arrival, or request priority (lower first)")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=args.enable_prefix_caching, scheduling_policy=args.scheduling_policy,
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from trillium import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    with LLM(args.model, **_engine_kwargs(args)) as llm:
        for output in llm.generate(args.prompts, params):
            print(f"{output.prompt!r} -> {output.outputs[0].text!r} ({output.outputs[0].finish_reason})")
    return 0


def _cmd_build_model(args: argparse.Namespace) -> int:
    from trillium.models.synthetic import build_checkpoint

    path = build_checkpoint(args.path, args.variant, seed=args.seed)
    print(path)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.suite == "throughput":
        from trillium.benchmarks.throughput import main as run_throughput

        return run_throughput(args.rest)
    raise SystemExit(f"unknown benchmark {args.suite!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trillium", description="Trillium LLM inference server")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions offline with the in-process engine")
    _add_engine_args(gen)
    gen.add_argument("prompts", nargs="+", help="prompt texts")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=_cmd_generate)

    build = sub.add_parser("build-model", help="write a small deterministic random checkpoint")
    build.add_argument("path")
    build.add_argument("--variant", default="llama",
                       help="llama, llama-linear, llama-dynamic, llama-tied, mistral, qwen2, qwen3, bench")
    build.add_argument("--seed", type=int, default=0)
    build.set_defaults(func=_cmd_build_model)

    bench = sub.add_parser("bench", help="run a benchmark (see bench/)")
    bench.add_argument("suite", choices=["throughput"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
