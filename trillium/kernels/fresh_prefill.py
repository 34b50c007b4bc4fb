"""Context-free prefills attend over this step's own keys: no cache gather, one call per run (the C
kernel for float32 on the CPU, else SDPA).

Used by the torch reference's `paged_attention` (reference.py) when the
caller hands in this step's k, v (models/kv_cache.py `KvCache.attend`).

    runs, rest = plan_runs(query_lens, seq_lens, starts, window)
        runs: `Run`s of consecutive sequences whose whole context is this
              step's tokens (seq_len == q_len > 1, inside any window) and
              share one q_len; rest: the indices of the other prefills
    attend_run(q, k, v, run, scale, enable_gqa) -> [rows, H, D]
              (float32 on the CPU: the C kernel, paged_attention_cpu.fresh_prefill_attention;
              otherwise SDPA)

WHY: a prompt's first chunk (no cached prefix) sees only keys this step
computed, and a float cache of q's dtype holds them unchanged, so gathering
them back out of the paged cache (two index_selects per sequence per layer)
only copies. And equal-length prompts, the common pooling batch (embeddings,
rerank pairs cut to one size), go in as one [B, H, L, D] causal SDPA call
instead of B calls, each with its own output copy. Measured on the bench
embedding model (8 layers, H 8 / KH 4, D 64), 16 x 256 tokens, 2 loaded
cores: the gathers were ~16% and the per-sequence output copies ~8% of the
forward. Same math: each (sequence, head) is attended on its own either way.

INVARIANT: only for caches that hold k, v bit for bit (not fp8: those
store k / scale, and the gathered, widened values differ); the caller
decides (`fresh` in reference._plan's key).
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from trillium.kernels import paged_attention_cpu


@attrs.frozen
class Run:
    """`num_seqs` consecutive context-free prefills of `q_len` tokens each, at `rows`."""

    rows: slice
    num_seqs: int
    q_len: int


def plan_runs(qlens: list[int], slens: list[int], starts: list[int], window: int | None
              ) -> tuple[tuple[Run, ...], list[int]]:
    """The runs of context-free prefills, and the indices of the prefills that gather."""
    runs: list[Run] = []
    rest: list[int] = []
    for b, (qlen, slen) in enumerate(zip(qlens, slens)):
        if qlen <= 1:
            continue
        if slen != qlen or (window is not None and slen > window):
            rest.append(b)
            continue
        last = runs[-1] if runs else None
        if last is not None and last.q_len == qlen and last.rows.stop == starts[b]:
            runs[-1] = Run(slice(last.rows.start, starts[b + 1]), last.num_seqs + 1, qlen)
        else:
            runs.append(Run(slice(starts[b], starts[b + 1]), 1, qlen))
    return tuple(runs), rest


def attend_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: Run, scale: float,
               enable_gqa: bool) -> torch.Tensor:
    """Causal attention of each sequence of `run` over its own keys -> [rows, H, D]. float32 on the CPU
    takes the C kernel (paged_attention_cpu.fresh_prefill_attention; SDPA's flash kernel ran the bench
    model's prompts at about half its speed), the rest SDPA."""
    qr, kr, vr = q[run.rows], k[run.rows], v[run.rows]
    if paged_attention_cpu.prefill_supported(qr, kr, vr):
        out = paged_attention_cpu.fresh_prefill_attention(qr, kr, vr, run.num_seqs, run.q_len, scale)
        if out is not None:
            return out
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    shape = (run.num_seqs, run.q_len)
    # WHY 4-D: CPU SDPA's flash kernel (3-D inputs fall back to the math path, reference.py).
    o = F.scaled_dot_product_attention(
        qr.view(*shape, num_heads, head_dim).transpose(1, 2),
        kr.view(*shape, num_kv_heads, head_dim).transpose(1, 2),
        vr.view(*shape, num_kv_heads, head_dim).transpose(1, 2),
        is_causal=True, scale=scale, enable_gqa=enable_gqa,
    )
    return o.transpose(1, 2).reshape(run.num_seqs * run.q_len, num_heads, head_dim)
