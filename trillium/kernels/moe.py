"""Mixture-of-experts: top-k routing and the expert MLPs of a flat token batch (torch, any device).

    route(router_logits [T, E], top_k, renormalize) -> (weights [T, k] float32, ids [T, k] int64)
    fused_moe(x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights [T, k], ids [T, k], activation) -> [T, H]

w13 holds each expert's [gate | up] rows, w2 its down projection (HF's
`experts.N.{gate,up,down}_proj`, Mixtral's w1 / w3 / w2).

WHY grouped by expert: the T * k (token, expert) pairs are sorted by expert
once, each expert with any tokens runs two matmuls over its contiguous rows,
and the weighted rows are summed back per token with one index_add. HF's
loop builds a one-hot [E, k, T] mask and runs `torch.where` per expert
instead, and a gathered bmm copies a weight matrix per pair. Measured
(bench/moe_cpu.py, float32, H 512, on a loaded 2-core box): grouped 1.05-1.5x
faster than HF's loop at 256-1024 tokens, level with it at decode sizes;
the bmm 2-20x slower than both.

NOTE: no Triton path: on CUDA this runs the same torch ops (one launch
pair per active expert), correct but not tuned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax in float32 -> top-k -> (optionally) renormalised to sum 1, as HF's TopKRouter."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"unsupported expert activation {activation!r}")


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """sum_k weight[t, k] * expert_{ids[t, k]}(x[t]) for every token t (in x's dtype).

    INVARIANT: per token the experts are added in ascending expert order,
    HF's order, so float32 results agree with it to the last rounding.
    """
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    token_of = order // top_k
    rows = x.index_select(0, token_of)
    expert_out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        block = slice(start, start + count)
        hidden = _act_and_mul(F.linear(rows[block], w13[expert]), activation)
        expert_out[block] = F.linear(hidden, w2[expert])
        start += count
    weights = topk_weights.reshape(-1).index_select(0, order).to(x.dtype)
    return out.index_add_(0, token_of, expert_out * weights[:, None])
