"""Torch reference implementations of every kernel (CPU path, test oracle).

These run on any device and define the semantics that the Triton kernels in
this package must match. See `metadata.py` for the batch and cache layout.

fp8 KV caches hold keys and values divided by a per-tensor scale (see
`fp8.py`); float caches take no scale and do no extra work.

NOTE on size (~475 lines): every op's torch reference in one module, the
single oracle the Triton kernels are tested against.
"""

from __future__ import annotations

import threading

import attrs
import torch
import torch.nn.functional as F

from trillium.kernels import paged_attention_cpu
from trillium.kernels.fp8 import is_fp8, quantize_fp8, widen_fp8
from trillium.kernels.fresh_prefill import Run, attend_run, plan_runs
from trillium.kernels.metadata import AttentionMetadata


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # One ATen op instead of six; bit-identical to the formula below in float32.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(dtype) if dtype != torch.float32 else xf * weight


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] laid out as [gate | up] -> silu(gate) * up: [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding, as HF Llama applies it.

    positions: [T] int64; q: [T, H, D]; k: [T, KH, D];
    cos_sin_cache: [max_pos, D] float32 holding [cos(D/2) | sin(D/2)].
    Returns new (q, k) tensors of the input dtype.
    """
    cos_sin = cos_sin_cache.index_select(0, positions)
    half = cos_sin.shape[-1] // 2
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)

    return rotate(q), rotate(k)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter k, v: [T, KH, D] into the caches at slot_mapping: [T] (in place).

    fp8 caches get x / scale, saturated (see the module docstring).
    """
    num_blocks, block_size, kh, d = k_cache.shape
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = cache.view(num_blocks * block_size, kh, d)
        if is_fp8(cache.dtype):
            # NOTE: CPU has no fp8 index_copy_; the bytes are the same.
            flat.view(torch.uint8).index_copy_(0, slot_mapping, quantize_fp8(x, scale, cache.dtype).view(torch.uint8))
        else:
            flat.index_copy_(0, slot_mapping, x.to(cache.dtype))


# WHY: decode gathers of K/V are MiBs per layer. Gathering the whole batch at
# once writes the copy out to DRAM and reads it back in SDPA, and fresh
# allocations of that size page-fault on every call (glibc hands them back to
# the OS). Chunks of about this many bytes (K + V) stay in the last-level
# cache, and a reused per-thread workspace avoids the faults. Measured on 2
# cores at batch 32 decode, H 8 / KH 4, D 64, ctx 256-400, block 16, fp32:
# 2.0-9.3 ms (bimodal, faults) -> 1.35-1.7 ms per call; SDPA over a
# contiguous static cache of the same shape: 0.9-1.2 ms. The rest of the gap
# is the gather copy itself.
_GATHER_CHUNK_BYTES = 8 << 20
_WORKSPACE_MAX_BYTES = 64 << 20


class _GatherWorkspace(threading.local):
    """Grow-only scratch buffers for gathered K/V, one per (device, dtype) and thread.

    INVARIANT: a buffer is only borrowed for the duration of one SDPA call and
    never escapes (SDPA returns fresh memory), so reuse is safe.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def borrow(self, numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        if numel * dtype.itemsize > _WORKSPACE_MAX_BYTES:
            return None
        # WHY: a buffer made under inference_mode is an inference tensor, which
        # may not be written outside it (and vice versa for views); keep one per mode.
        key = (device, dtype, torch.is_inference_mode_enabled())
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:numel]


_workspace = _GatherWorkspace()


def _gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-block gather: table [..., n] of block ids -> K, V [..., n * block_size, KH, D] in `dtype`.

    Block granularity (16 KiB rows at block 16, KH 4, D 64) keeps index_select on
    its memcpy path; a per-token gather is several times slower. fp8 blocks
    are gathered as they are, then widened to `dtype` (see `_widen`).
    """
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    flat_table = table.reshape(-1)
    block_numel = block_size * num_kv_heads * head_dim
    numel = flat_table.numel() * block_numel
    shape = (*table.shape[:-1], table.shape[-1] * block_size, num_kv_heads, head_dim)
    # CUDA has a caching allocator; only host allocations fault.
    reusable = (
        k_cache.device.type == "cpu"
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and v_cache.dtype == k_cache.dtype
    )
    buf = _workspace.borrow(2 * numel, k_cache.device, k_cache.dtype) if reusable else None
    if buf is None:
        keys = k_cache.index_select(0, flat_table)
        values = v_cache.index_select(0, flat_table)
    else:
        gathered = (flat_table.numel(), block_size, num_kv_heads, head_dim)
        keys = torch.index_select(k_cache, 0, flat_table, out=buf[:numel].view(gathered))
        values = torch.index_select(v_cache, 0, flat_table, out=buf[numel:].view(gathered))
    if keys.dtype != dtype:
        keys, values = _widen(keys, values, dtype, reusable)
    return keys.view(shape), values.view(shape)


def _widen(
    keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype, reusable: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered fp8 K, V -> `dtype`, into a second workspace buffer when allowed.

    Exact: every e4m3fn / e5m2 value is a float32, bfloat16 and float16 value.
    The scales are applied to q and the output instead (see `paged_attention`).
    """
    numel = keys.numel()
    buf = _workspace.borrow(2 * numel, keys.device, dtype) if reusable else None
    if buf is None:
        buf = torch.empty(2 * numel, dtype=dtype, device=keys.device)
    e4m3 = reusable and keys.dtype == torch.float8_e4m3fn  # only its widening needs int16 scratch
    scratch = _workspace.borrow(numel, keys.device, torch.int16) if e4m3 else None
    return (
        widen_fp8(keys, buf[:numel].view(keys.shape), scratch),
        widen_fp8(values, buf[numel:].view(values.shape), scratch),
    )


# ---- the per-step plan -------------------------------------------------------
#
# Everything paged_attention derives from the metadata alone (which rows
# form which SDPA call, their block ids, masks) is the same in every layer, so
# it is built on the first layer's call and kept in `meta.derived`; later
# layers only gather and attend.


@attrs.frozen
class _DecodeChunk:
    """Decode rows attended by one SDPA call over gathered K/V."""

    rows: slice | torch.Tensor  # their rows in q / out (a slice when consecutive)
    table: torch.Tensor  # [Bc, max_blocks] block ids, contiguous
    max_len: int  # keys 0..max_len-1 are attended
    mask: torch.Tensor | None  # [Bc, 1, 1, max_len] additive (0 / -inf); None when lengths are equal


@attrs.frozen
class _PrefillSeq:
    """One sequence with q_len > 1, attended by its own SDPA call."""

    rows: slice
    table: torch.Tensor  # [num_blocks] block ids (with a window: from the first block it reads)
    seq_len: int  # keys gathered from `table` and attended (masked)
    mask: torch.Tensor | None  # [q_len, seq_len] bool (True: attend); None: plain causal (no context)
    context: int | None = None  # keys before the chunk where it attends plain causally after them (no window)


@attrs.frozen
class _Plan:
    decode: tuple[_DecodeChunk, ...]
    prefill: tuple[_PrefillSeq, ...]
    decode_rows_in_order: bool  # the chunks' rows, concatenated, are all T rows in order
    fresh: tuple[Run, ...] = ()  # context-free prefills over this step's k, v (fresh_prefill.py)


def _plan(meta: AttentionMetadata, k_cache: torch.Tensor, dtype: torch.dtype, window: int | None,
          fresh: bool = False) -> _Plan:
    """The plan for this batch, cache geometry and sliding window, built once per step.
    `fresh`: context-free prefills attend over this step's k, v (fresh_prefill.py).

    NOTE: models with both full and sliding layers (Gemma) keep two plans.
    """
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    key = ("reference.paged_attention", block_size, num_kv_heads, head_dim, k_cache.dtype,
           k_cache.device, dtype, _GATHER_CHUNK_BYTES, window, fresh)  # fmt: skip
    plan = meta.derived.get(key)
    if plan is None:
        plan = meta.derived[key] = _build_plan(meta, k_cache, dtype, window, fresh)
    return plan


def _windowed(slen: int, window: int | None) -> bool:
    """Does a query at the end of a `slen`-token sequence miss keys behind the window?"""
    return window is not None and slen > window


def _build_plan(meta: AttentionMetadata, k_cache: torch.Tensor, dtype: torch.dtype, window: int | None,
                fresh: bool = False) -> _Plan:
    device = k_cache.device
    qlens, slens = meta.query_lens_list, meta.seq_lens_list
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    decode_idx = [b for b, n in enumerate(qlens) if n == 1]
    chunks = tuple(
        _decode_chunk_plan(meta, seqs, starts, k_cache.shape[1], device, dtype, window)
        for seqs in (_decode_chunks(decode_idx, meta, k_cache, dtype) if decode_idx else [])
    )
    prefill = []
    block_size = k_cache.shape[1]
    runs, gathered = plan_runs(qlens, slens, starts, window) if fresh else ((), range(len(qlens)))
    for b in gathered:
        qlen = qlens[b]
        if qlen > 1:
            slen = slens[b]
            nblk = -(-slen // block_size)
            # Query i (position ctx+i) sees keys j <= ctx+i. With no context
            # that is plain (top-left) causal, which SDPA can do without a mask.
            # NOTE: kept boolean (a quarter of the bytes of an additive float32
            # mask); converting it per layer is noise next to prefill attention.
            ctx = slen - qlen
            mask = None if ctx == 0 else torch.ones(qlen, slen, dtype=torch.bool, device=device).tril(ctx)
            first = 0
            if _windowed(slen, window):
                # Sliding window (HF `sliding_window_overlay`): query at p sees keys j with p - window < j <= p.
                base = torch.ones(qlen, slen, dtype=torch.bool, device=device)
                mask = base.tril(ctx) & base.triu(ctx - window + 1)
                # Blocks wholly behind the first query's window are not gathered (they may be freed).
                first = max(0, ctx - window + 1) // block_size
                mask = mask[:, first * block_size :]
            prefill.append(_PrefillSeq(slice(starts[b], starts[b + 1]), meta.block_tables[b, first:nblk],
                                       slen - first * block_size, mask, None if _windowed(slen, window) else ctx))
    in_order = len(decode_idx) == len(qlens) and decode_idx == list(range(len(qlens)))
    return _Plan(chunks, tuple(prefill), in_order, runs)


def _decode_chunk_plan(
    meta: AttentionMetadata, seqs: list[int], starts: list[int], block_size: int,
    device: torch.device, dtype: torch.dtype, window: int | None,
) -> _DecodeChunk:  # fmt: skip
    lens = [meta.seq_lens_list[b] for b in seqs]
    max_len = max(lens)
    max_blocks = -(-max_len // block_size)
    if _is_run(seqs):
        first, last = seqs[0], seqs[-1] + 1
        rows: slice | torch.Tensor = slice(starts[first], starts[first] + len(seqs))
        table = meta.block_tables[first:last, :max_blocks]
    else:
        rows = torch.tensor([starts[b] for b in seqs], device=device)
        table = meta.block_tables.index_select(0, torch.tensor(seqs, device=device))[:, :max_blocks]
    if _windowed(max_len, window):
        return _windowed_decode_chunk(rows, table, lens, block_size, window, device, dtype)
    mask = None
    if min(lens) != max_len:
        keys = torch.arange(max_len, device=device)[None, :]
        ends = torch.tensor(lens, device=device)[:, None]
        mask = _additive(keys < ends, dtype)[:, None, None, :]
    return _DecodeChunk(rows, table.contiguous(), max_len, mask)


def _windowed_decode_chunk(
    rows: slice | torch.Tensor, table: torch.Tensor, lens: list[int], block_size: int, window: int,
    device: torch.device, dtype: torch.dtype,
) -> _DecodeChunk:  # fmt: skip
    """Decode rows under a sliding window: each row gathers only the blocks
    from the one holding its first visible key (position len - window) on.

    WHY: blocks behind the window may be freed (the scheduler's NULL_BLOCK or
    a block another request now owns, kv_tiers/block_pool.py) and are never
    read; it also bounds the gather to ~window keys. Row b's gathered key j
    sits at position start_b * block_size + j; rows with fewer blocks repeat
    their last one (its keys masked).
    """
    starts = [max(0, n - window) // block_size for n in lens]
    width = max(-(-n // block_size) - s for n, s in zip(lens, starts))  # host lists: no device sync
    ends = torch.tensor(lens, device=device)[:, None]
    first = torch.tensor(starts, device=device)[:, None]
    index = torch.minimum(first + torch.arange(width, device=device)[None, :], -(-ends // block_size) - 1)
    positions = first * block_size + torch.arange(width * block_size, device=device)[None, :]
    valid = (positions < ends) & (positions >= ends - window)  # the query sits at ends - 1
    return _DecodeChunk(rows, table.gather(1, index.to(torch.int64)).contiguous(), width * block_size,
                        _additive(valid, dtype)[:, None, None, :])


def _additive(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean keep-mask -> additive 0 / -inf mask, what SDPA turns a bool mask into on every call."""
    return torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))


def _decode_chunks(
    decode_idx: list[int], meta: AttentionMetadata, k_cache: torch.Tensor, dtype: torch.dtype
) -> list[list[int]]:
    """Split decode sequences into equal chunks of about _GATHER_CHUNK_BYTES of K + V each (in `dtype`)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    slens = meta.seq_lens_list
    max_blocks = (max(slens[b] for b in decode_idx) + block_size - 1) // block_size
    per_seq_bytes = 2 * max_blocks * block_size * num_kv_heads * head_dim * dtype.itemsize
    num_chunks = min(len(decode_idx), -(-per_seq_bytes * len(decode_idx) // _GATHER_CHUNK_BYTES))
    size = -(-len(decode_idx) // num_chunks)
    return [decode_idx[i : i + size] for i in range(0, len(decode_idx), size)]


def _is_run(seqs: list[int]) -> bool:
    """True when the sequence indices are consecutive and ascending (their decode rows are too)."""
    return seqs == list(range(seqs[0], seqs[0] + len(seqs)))


# ---- attention -----------------------------------------------------------------


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of flat varlen queries over the paged KV cache.

    q: [T, H, D] -> out: [T, H, D]. Handles prefill (with a prefix-cached
    context), chunked prefill and decode in one call: query i of sequence b
    sits at position seq_len - q_len + i and sees keys 0..that position.
    GQA: H must be a multiple of the cache's KV heads.

    WHY this shape on CPU: decode rows (q_len == 1) are gathered into padded
    batches (a few cache-sized chunks) and run as one SDPA call per chunk; the
    few prefill sequences run one SDPA call each (float32 on the CPU: the C
    prefill kernels instead, reading the cache in place; `_attend_prefill`). A per-sequence loop over
    decodes would cost one call per sequence per layer. Which rows go where
    (and their masks) is planned once per step, see `_plan`.

    INVARIANT (CPU path only): padded decode rows read, then mask, cache slots
    past their sequence's end (the tail of its last block, block-table
    padding). Those slots must hold finite values, i.e. allocate caches with
    zeros: SDPA still multiplies masked V rows by 0, and 0 * NaN is NaN.
    Zeroing the tails per call would cost ~10% of decode attention. The
    Triton kernel never loads them.

    fp8 caches: K and V are widened to q's dtype, and the scales go where
    they cost least: (q * k_scale) . k == q . (k * k_scale) and
    sum p (v * v_scale) == v_scale * sum p v, on T rows instead of every
    gathered key.

    sliding_window: a query at position p sees keys p - window < j <= p only
    (Mistral, Gemma's local layers); the cache still holds every key.
    softcap: scores become softcap * tanh(scores / softcap) before the
    softmax (Gemma 2); SDPA has no such hook, so those calls run the
    matmul-softmax-matmul in torch (`_sdpa`).
    k, v: this step's keys / values [T, KH, D], just written to the cache
    (optional): context-free prefills then attend over them without a gather,
    equal-length runs in one call (fresh_prefill.py); not for fp8 caches.
    """
    fresh = k is not None and v is not None and softcap is None and k_cache.dtype == q.dtype == k.dtype
    if k_scale is not None and is_fp8(k_cache.dtype):
        q = _scaled(q, k_scale)
    out = _attend(q, k_cache, v_cache, meta, scale, sliding_window, softcap, (k, v) if fresh else None)
    if v_scale is not None and is_fp8(v_cache.dtype):
        out = _scaled(out, v_scale)
    return out


def _scaled(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * scale (a float32 one-element tensor), rounded once to x's dtype."""
    return x * scale if x.dtype == torch.float32 else (x.float() * scale).to(x.dtype)


def _attend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    window: int | None, softcap: float | None, kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    plan = _plan(meta, k_cache, q.dtype, window, kv is not None)
    enable_gqa = q.shape[1] != k_cache.shape[2]
    if kv is not None and not plan.decode and not plan.prefill and len(plan.fresh) == 1:
        # Only context-free prefills of one length (a pooling batch): one call, no scatter.
        run = plan.fresh[0]
        if run.rows.start == 0 and run.rows.stop == q.shape[0]:
            return attend_run(q, *kv, run, scale, enable_gqa)
    if plan.decode_rows_in_order and plan.decode:
        # Pure decode batch: no scatter into `out`.
        outs = [_attend_decode(q, k_cache, v_cache, chunk, scale, softcap) for chunk in plan.decode]
        return outs[0].contiguous() if len(outs) == 1 else torch.cat(outs)
    out = torch.empty_like(q)
    for chunk in plan.decode:
        o = _attend_decode(q, k_cache, v_cache, chunk, scale, softcap)
        if isinstance(chunk.rows, slice):
            out[chunk.rows] = o
        else:
            out.index_copy_(0, chunk.rows, o)
    for seq in plan.prefill:
        out[seq.rows] = _attend_prefill(q, k_cache, v_cache, seq, scale, enable_gqa, softcap)
    for run in plan.fresh:
        out[run.rows] = attend_run(q, *kv, run, scale, enable_gqa)
    return out


def _attend_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: _DecodeChunk,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """One SDPA call for the decode rows of `chunk` -> [Bc, H, D].

    WHY grouped: the H / KH query heads that share a KV head go in as that
    head's query rows ([Bc, KH, H / KH, D]; with one query token per
    sequence no causal mask is needed between them), so SDPA reads each
    gathered K/V row once instead of once per query head (enable_gqa):
    ~13% less SDPA time at H 8 / KH 4. Same math; the dot products may round
    differently (~1e-7).
    """
    qd = q[chunk.rows] if isinstance(chunk.rows, slice) else q.index_select(0, chunk.rows)
    num_seqs, num_heads, head_dim = qd.shape
    num_kv_heads = k_cache.shape[2]
    keys, values = _gather_kv(k_cache, v_cache, chunk.table, q.dtype)  # [Bc, max_blocks * bs, KH, D]
    o = _sdpa(
        qd.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim),
        keys[:, : chunk.max_len].transpose(1, 2),
        values[:, : chunk.max_len].transpose(1, 2),
        chunk.mask,
        scale,
        softcap,
    )
    return o.reshape(num_seqs, num_heads, head_dim)


def _attend_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq: _PrefillSeq,
    scale: float,
    enable_gqa: bool,
    softcap: float | None = None,
) -> torch.Tensor:
    """SDPA for one sequence with q_len > 1 -> [q_len, H, D].

    float32 on the CPU without a window or soft-capping takes the C kernel instead, reading the keys
    where the cache holds them (paged_attention_cpu.context_prefill_attention: a 4000-token prompt's
    later chunks spent ~47% of its prefill in SDPA and the gathers). Same math, rounded otherwise."""
    if softcap is None and seq.context is not None:
        qs = q[seq.rows]
        if paged_attention_cpu.context_prefill_supported(qs, k_cache, v_cache, seq.table):
            out = paged_attention_cpu.context_prefill_attention(qs, k_cache, v_cache, seq.table, seq.context, scale)
            if out is not None:
                return out
    keys, values = _gather_kv(k_cache, v_cache, seq.table, q.dtype)  # [nblk * bs, KH, D]
    if softcap is not None:
        qs = q[seq.rows].transpose(0, 1)
        ks, vs = keys[: seq.seq_len].transpose(0, 1), values[: seq.seq_len].transpose(0, 1)
        if enable_gqa:
            group = qs.shape[0] // ks.shape[0]
            ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        mask = seq.mask if seq.mask is not None else torch.ones(qs.shape[1], ks.shape[1], dtype=torch.bool,
                                                                  device=qs.device).tril()  # fmt: skip
        return _sdpa(qs, ks, vs, _additive(mask, q.dtype), scale, softcap).transpose(0, 1)
    # WHY 4-D ([1, H, Q, D]): on CPU, 3-D inputs fall back to SDPA's math path (an
    # explicit tril mask and softmax); 4-D ones reach the flash kernel, ~12x faster at
    # 356 tokens, 8 / 4 heads (the prefill of long prompts and of pooling requests).
    o = F.scaled_dot_product_attention(
        q[seq.rows].transpose(0, 1).unsqueeze(0),
        keys[: seq.seq_len].transpose(0, 1).unsqueeze(0),
        values[: seq.seq_len].transpose(0, 1).unsqueeze(0),
        attn_mask=seq.mask,
        is_causal=seq.mask is None,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    return o[0].transpose(0, 1)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
    softcap: float | None,
) -> torch.Tensor:  # fmt: skip
    """softmax(q k^T * scale [soft-capped] + mask) v; additive mask; same head count in q's group dims.

    Without softcap this is SDPA. With it, the order of HF's eager Gemma 2
    attention: scale, cap * tanh(s / cap), add the mask, softmax in float32.
    """
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)
