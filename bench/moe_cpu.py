"""CPU cost of the expert MLPs of one MoE layer: grouped by expert (ours) vs HF's loop vs a gathered bmm.

Run: .venv/bin/python bench/moe_cpu.py [--threads 2] [--repeats 20]

Three implementations of the same sum over top-k experts, float32:
  grouped  `trillium.kernels.moe.fused_moe`: sort (token, expert) pairs by
           expert once, two matmuls per active expert over contiguous rows,
           one index_add back;
  hf-loop  transformers 5's Experts.forward: one-hot mask [E, k, T], then per
           hit expert `torch.where` + gather + two matmuls + index_add;
  bmm      gather each pair's expert weights ([T*k, 2I, H], [T*k, H, I]) and
           run two batched matmuls (no per-expert Python loop).
Shapes: "mixtral-ish" E 8, k 2, H 512, I 1024 and "qwen3-moe-ish" E 64, k 8,
H 512, I 256, at 1..1024 tokens; median of --repeats calls, milliseconds.

Measured on the 2-core dev box shared with other jobs (load average ~11,
so +-30% noise; --threads 1 --repeats 10, torch 2.13 CPU), ms:

    shape          tokens  grouped  hf-loop      bmm
    mixtral-ish         1     3.79     1.89    12.16
    mixtral-ish         8    17.68    17.34   249.23
    mixtral-ish        32    44.26    50.00   981.32
    mixtral-ish       256    90.70    95.83        -
    mixtral-ish      1024   280.98   351.74        -
    qwen3-moe-ish       1     6.05    10.61    12.12
    qwen3-moe-ish       8    31.26    39.30   300.41
    qwen3-moe-ish      32    72.90    85.75  1015.70
    qwen3-moe-ish     256   147.47   184.78        -
    qwen3-moe-ish    1024   442.41   658.76        -

The gathered bmm copies a full expert matrix per (token, expert) pair and
loses everywhere; grouping wins over HF's loop as experts and tokens grow
(1.05-1.5x at 256-1024 tokens), ties at decode sizes. The matmuls dominate:
NOTE the kernel calls F.linear; the oneDNN path `llama.linear` uses was not
tried here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from trillium.kernels.moe import fused_moe, route

SHAPES = {"mixtral-ish": (8, 2, 512, 1024), "qwen3-moe-ish": (64, 8, 512, 256)}
TOKENS = (1, 8, 32, 256, 1024)


def hf_loop(x, w13, w2, weights, ids):
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=w13.shape[0]).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in hit[:, 0].tolist():
        slot, token = torch.where(mask[expert])
        gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


def gathered_bmm(x, w13, w2, weights, ids):
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    rows = x.repeat_interleave(top_k, dim=0)[:, None, :]  # [T*k, 1, H]
    gate_up = torch.bmm(rows, w13.index_select(0, flat).transpose(1, 2))[:, 0]
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch.bmm((F.silu(gate) * up)[:, None, :], w2.index_select(0, flat).transpose(1, 2))[:, 0]
    return (y.view(num_tokens, top_k, -1) * weights[..., None]).sum(1)


def median_ms(fn, args, repeats: int) -> float:
    fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per cell (median reported)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"{'shape':14s} {'tokens':>6s} {'grouped':>8s} {'hf-loop':>8s} {'bmm':>8s}")
    with torch.inference_mode():
        for shape, (experts, top_k, hidden, inter) in SHAPES.items():
            w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
            w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
            for tokens in TOKENS:
                x = torch.randn(tokens, hidden, generator=gen)
                weights, ids = route(torch.randn(tokens, experts, generator=gen), top_k, True)
                call = (x, w13, w2, weights, ids)
                ref = hf_loop(*call)
                assert torch.allclose(fused_moe(*call), ref, atol=1e-4)
                cells = [median_ms(fused_moe, call, args.repeats), median_ms(hf_loop, call, args.repeats)]
                # WHY capped: the gathered weights are T*k full expert matrices (GiBs at 1024 tokens).
                bmm = median_ms(gathered_bmm, call, args.repeats) if tokens * top_k <= 256 else float("nan")
                print(f"{shape:14s} {tokens:6d} {cells[0]:8.2f} {cells[1]:8.2f} {bmm:8.2f}")


if __name__ == "__main__":
    main()
