"""Causal prefill attention on CPU: the C kernel against torch's SDPA, in one run.

Run: .venv/bin/python bench/prefill_attention.py [--prompts 64] [--rounds 3] [--threads 2]
     .venv/bin/python bench/prefill_attention.py --context [--prompt-len 4096] [--chunk 1024]

The bench model's attention shape (8 query heads, 4 KV heads, head dim 64) over prompts of the
`all64` workload's lengths (uniform 32-512, seeded), q / k / v as the slices of one qkv projection
(as the model hands them in): per round, every prompt's causal attention once per layer (8), through
trillium/kernels/paged_attention_cpu.c `trillium_fresh_prefill_attention` (what
fresh_prefill.attend_run runs for float32 on the CPU now) and through SDPA's flash kernel (what it
ran before, and still runs under TRILLIUM_KERNELS=reference), alternated. Prints the median ms per
round, GFLOP/s (the causal half of the score and value products) and the largest difference
between the two. Nothing is asserted.

--context: a long prompt's later chunks instead (`--prompt-len` tokens in chunks of `--chunk`, the
server's --max-num-batched-tokens): each chunk's queries over its context and itself, read from a
float32 paged cache through a shuffled block table, through `trillium_paged_prefill_attention` (what
reference._attend_prefill runs for float32 on the CPU now) and through the gather + SDPA it ran
before (`reference.paged_attention` under TRILLIUM_KERNELS=reference), alternated.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
import torch.nn.functional as F

from trillium.kernels import AttentionMetadata, paged_attention_cpu, reference

H, KH, D, LAYERS = 8, 4, 64, 8


def _sdpa(q, k, v):
    n = q.shape[0]
    o = F.scaled_dot_product_attention(q.view(1, n, H, D).transpose(1, 2), k.view(1, n, KH, D).transpose(1, 2),
                                       v.view(1, n, KH, D).transpose(1, 2), is_causal=True, scale=D**-0.5,
                                       enable_gqa=True)
    return o.transpose(1, 2).reshape(n, H, D)


def _kernel(q, k, v):
    return paged_attention_cpu.fresh_prefill_attention(q, k, v, 1, q.shape[0], D**-0.5)


def _context_chunks(args) -> None:
    """--context: the later chunks of one long prompt, kernel against gather + SDPA."""
    gen = torch.Generator().manual_seed(args.seed)
    block = 16
    blocks = -(-args.prompt_len // block)
    k_cache, v_cache = (torch.randn(blocks + 8, block, KH, D, generator=gen) for _ in range(2))
    table = torch.randperm(blocks + 8, generator=gen)[:blocks].to(torch.int32)
    chunks = [(ctx, min(args.chunk, args.prompt_len - ctx)) for ctx in range(args.chunk, args.prompt_len, args.chunk)]
    steps = []
    for ctx, n in chunks:
        meta = AttentionMetadata.build([n], [ctx + n], [table.tolist()], block)
        steps.append((torch.randn(n, H, D, generator=gen), meta))

    def run(reference_path: bool) -> list[torch.Tensor]:
        if reference_path:
            os.environ["TRILLIUM_KERNELS"] = "reference"
        try:
            return [reference.paged_attention(q, k_cache, v_cache, meta, D**-0.5) for q, meta in steps]
        finally:
            os.environ.pop("TRILLIUM_KERNELS", None)

    diff = max((a - b).abs().max().item() for a, b in zip(run(False), run(True)))
    flops = LAYERS * sum(2 * 2 * n * (ctx + n / 2) * D * H for ctx, n in chunks)
    times: dict[str, list[float]] = {"kernel": [], "sdpa": []}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name in ("kernel", "sdpa"):
                start = time.perf_counter()
                for _ in range(LAYERS):
                    run(name == "sdpa")
                times[name].append(time.perf_counter() - start)
    kernel, sdpa = (statistics.median(times[n]) for n in ("kernel", "sdpa"))
    print(f"a {args.prompt_len}-token prompt's chunks after the first ({len(chunks)} of up to {args.chunk} rows, "
          f"contexts {chunks[0][0]}-{chunks[-1][0]}), {LAYERS} layers, H {H} / KH {KH}, D {D}, {args.threads} threads, "
          f"median of {args.rounds} alternated rounds")
    print(f"{'':>14} {'ms':>9} {'GFLOP/s':>8}")
    print(f"{'kernel':>14} {kernel * 1e3:>9.1f} {flops / kernel / 1e9:>8.1f}")
    print(f"{'gather + SDPA':>14} {sdpa * 1e3:>9.1f} {flops / sdpa / 1e9:>8.1f}")
    print(f"kernel over gather + SDPA {sdpa / kernel:.2f}x; largest |difference| {diff:.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context", action="store_true", help="a long prompt's later chunks over the paged cache")
    p.add_argument("--prompt-len", type=int, default=4096, help="--context: the prompt's tokens")
    p.add_argument("--chunk", type=int, default=1024, help="--context: tokens a chunk (--max-num-batched-tokens)")
    args = p.parse_args()
    if not paged_attention_cpu.available():
        raise SystemExit(f"the kernel did not build: {paged_attention_cpu.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    if args.context:
        if args.prompt_len <= args.chunk or args.chunk <= 0:
            raise SystemExit("--prompt-len must be longer than one --chunk")
        _context_chunks(args)
        return
    rng = random.Random(args.seed)
    lengths = [rng.randint(32, 512) for _ in range(args.prompts)]
    gen = torch.Generator().manual_seed(args.seed)
    data = []
    for n in lengths:
        q, k, v = torch.randn(n, (H + 2 * KH) * D, generator=gen).split([H * D, KH * D, KH * D], dim=-1)
        data.append((q.view(n, H, D), k.view(n, KH, D), v.view(n, KH, D)))
    diff = max((_kernel(*t) - _sdpa(*t)).abs().max().item() for t in data)
    flops = LAYERS * sum(2 * 2 * n * n / 2 * D * H for n in lengths)
    times: dict[str, list[float]] = {"kernel": [], "sdpa": []}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, fn in (("kernel", _kernel), ("sdpa", _sdpa)):
                start = time.perf_counter()
                for _ in range(LAYERS):
                    for t in data:
                        fn(*t)
                times[name].append(time.perf_counter() - start)
    kernel, sdpa = (statistics.median(times[n]) for n in ("kernel", "sdpa"))
    print(f"{args.prompts} prompts ({sum(lengths)} tokens), {LAYERS} layers, H {H} / KH {KH}, D {D}, "
          f"{args.threads} threads, median of {args.rounds} alternated rounds")
    print(f"{'':>8} {'ms':>9} {'GFLOP/s':>8}")
    print(f"{'kernel':>8} {kernel * 1e3:>9.1f} {flops / kernel / 1e9:>8.1f}")
    print(f"{'SDPA':>8} {sdpa * 1e3:>9.1f} {flops / sdpa / 1e9:>8.1f}")
    print(f"kernel over SDPA {sdpa / kernel:.2f}x; largest |difference| {diff:.2e}")


if __name__ == "__main__":
    main()
