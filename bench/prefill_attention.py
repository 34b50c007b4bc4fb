"""Causal prefill attention on CPU: the C kernel against torch's SDPA, in one run.

Run: .venv/bin/python bench/prefill_attention.py [--prompts 64] [--rounds 3] [--threads 2]

The bench model's attention shape (8 query heads, 4 KV heads, head dim 64) over prompts of the
`all64` workload's lengths (uniform 32-512, seeded), q / k / v as the slices of one qkv projection
(as the model hands them in): per round, every prompt's causal attention once per layer (8), through
trillium/kernels/paged_attention_cpu.c `trillium_fresh_prefill_attention` (what
fresh_prefill.attend_run runs for float32 on the CPU now) and through SDPA's flash kernel (what it
ran before, and still runs under TRILLIUM_KERNELS=reference), alternated. Prints the median ms per
round, GFLOP/s (the causal half of the score and value products) and the largest difference
between the two. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from trillium.kernels import paged_attention_cpu

H, KH, D, LAYERS = 8, 4, 64, 8


def _sdpa(q, k, v):
    n = q.shape[0]
    o = F.scaled_dot_product_attention(q.view(1, n, H, D).transpose(1, 2), k.view(1, n, KH, D).transpose(1, 2),
                                       v.view(1, n, KH, D).transpose(1, 2), is_causal=True, scale=D**-0.5,
                                       enable_gqa=True)
    return o.transpose(1, 2).reshape(n, H, D)


def _kernel(q, k, v):
    return paged_attention_cpu.fresh_prefill_attention(q, k, v, 1, q.shape[0], D**-0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not paged_attention_cpu.available():
        raise SystemExit(f"the kernel did not build: {paged_attention_cpu.unavailable_reason()}")
    torch.set_num_threads(args.threads)
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
