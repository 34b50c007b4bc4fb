"""Decode attention on CPU over the paged KV cache in place: the C kernel in paged_attention_cpu.c.

    decode_supported(q, k_cache, v_cache, meta) -> bool   (this call can take the kernel)
    mixed_split(meta) -> (rows, meta, other rows, meta) | None   (a mixed step's decode rows and the rest)
    decode_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale, *, sliding_window, softcap) -> out
    available() -> bool, unavailable_reason() -> str | None   (a C compiler built the kernel here)
    prefill_supported(q, k, v) -> bool; fresh_prefill_attention(q, k, v, num_seqs, q_len, scale) -> out
        (causal attention of context-free prefills over their own keys: fresh_prefill.attend_run)
    context_prefill_supported(q, k_cache, v_cache, table) -> bool;
    context_prefill_attention(q, k_cache, v_cache, table, context, scale) -> out
        (one sequence's prefill chunk after a context, keys read from the paged cache in place:
        reference._attend_prefill)

What it replaces: for a pure decode step (every sequence has one query
token) `reference.paged_attention` gathers each sequence's blocks into a
dense [B, max_len, KH, D] copy (widening fp8 as it goes) and runs SDPA over
it with a padding mask. The kernel reads the blocks of each block table
where they lie, one 64-key chunk of one query row per work item (all its
heads; the GQA group's query heads share each K / V row; several chunks of a
row are merged as flash-decoding's split-K does, so one long sequence keeps
every thread busy), with an online softmax a block at a time and the next
block prefetched; padded slots, block-table padding and blocks behind a
sliding window are never read.

Taken: q float32 on the CPU with its head dim contiguous; caches float32, or
fp8 (float8_e4m3fn / float8_e5m2, with their per-tensor scales) read through
a 256-entry table built by `fp8.widen_fp8` (so the values are the
reference's, bit for bit); contiguous caches; int32 block tables and
sequence lengths (what `AttentionMetadata.build` makes). Sliding window and
soft-capping are in the kernel (the reference has both; it has no ALiBi, nor
does this). Everything else (prefill chunks, bfloat16 / float16 queries or
caches, no C compiler, TRILLIUM_KERNELS=reference) goes to the reference,
explicitly, in `dispatch.paged_attention`; the reference hands float32
prefill chunks to this file's prefill kernels (fresh_prefill.attend_run,
reference._attend_prefill). A mixed step (decode rows beside
prefill chunks) is split there (`mixed_split`): the decode rows take the
kernel, the prefill chunks the reference, so a decode row is computed as in
a decode step whatever else its step holds.

A speculative verify step (`meta.verify_rows`, at most `MAX_VERIFY_ROWS`
query rows per sequence: the last token and its drafts) takes the kernel
too: each query row is a row of its own, over its sequence's block
table, attending to the keys up to its own position, exactly as the decode
step of that position would (same kernel, same chunks, same summation order), where the
gather path would run SDPA over a dense copy.

Under compiled decode the kernel runs inside the opaque
`trillium::graph_attention` op (models/graph_attention.py), which already
has a fake implementation; so Inductor never traces this module and needs
no op of its own for it.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from trillium.kernels.c_library import CLibrary
from trillium.kernels.fp8 import FP8_DTYPES, widen_fp8
from trillium.kernels.metadata import AttentionMetadata

_SOURCE = Path(__file__).with_name("paged_attention_cpu.c")
_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


def _declare(lib: ctypes.CDLL) -> None:
    lib.trillium_paged_decode_attention.argtypes = [
        _P, _L, _L, _L, _L, _L,  # q, B, H, D, row stride, head stride
        _P, _P, _P, _L, _L,  # k, v, fp8 table, block size, KH
        _P, _L, _P, _P,  # block tables, their row stride, keys per query row, row -> table row
        _F, _P, _P, _L, _F,  # scale, k_scale, v_scale, window, softcap
        _P, ctypes.c_int,  # out, threads
    ]  # fmt: skip
    lib.trillium_paged_decode_attention.restype = ctypes.c_int
    lib.trillium_fresh_prefill_attention.argtypes = [
        _P, _L, _L, _P, _L, _L, _P, _L, _L,  # q, k, v with their row and head strides
        _L, _L, _L, _L, _L, _F, _P, ctypes.c_int,  # sequences, q_len, H, KH, D, scale, out, threads
    ]  # fmt: skip
    lib.trillium_fresh_prefill_attention.restype = ctypes.c_int
    lib.trillium_paged_prefill_attention.argtypes = [
        _P, _L, _L, _P, _P, _L, _L, _P,  # q with its row and head strides, k, v caches, block size, KH, table
        _L, _L, _L, _L, _F, _P, ctypes.c_int,  # context, q_len, H, D, scale, out, threads
    ]  # fmt: skip
    lib.trillium_paged_prefill_attention.restype = ctypes.c_int


_LIBRARY = CLibrary(_SOURCE, "the CPU paged decode attention kernel", _declare)
available = _LIBRARY.available
unavailable_reason = _LIBRARY.unavailable_reason
_FP8_TABLES: dict[torch.dtype, torch.Tensor] = {}
# Query rows per sequence a verify step may have here (k + 1); beyond it, the gather path's SDPA.
# WHY a bound: each row re-reads its sequence's keys, fine for a few rows, not for a prefill.
MAX_VERIFY_ROWS = 16
_ROWS_KEY = "paged_attention_cpu.rows"  # meta.derived: (row_seq, row_lens) of a verify step


def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """float32 [256]: the value of each fp8 code, as the reference widens it."""
    table = _FP8_TABLES.get(dtype)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
        table = _FP8_TABLES[dtype] = widen_fp8(codes, torch.empty(256, dtype=torch.float32))
    return table


def decode_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Can the kernel take this call? (cheap checks first: it runs once per layer per step)"""
    if q.dtype != torch.float32 or q.device.type != "cpu" or q.stride(-1) != 1 or q.shape[0] != meta.num_tokens:
        return False
    return step_supported(k_cache, v_cache, meta)


def step_supported(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """decode_supported's tests of the cache and the step, without a query (native_ops.Step asks once a step)."""
    if meta.max_query_len != 1 and not (meta.verify_rows and meta.max_query_len <= MAX_VERIFY_ROWS):
        return False
    if k_cache.dtype != v_cache.dtype or not (k_cache.dtype == torch.float32 or k_cache.dtype in FP8_DTYPES):
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.device.type != "cpu":
        return False
    if meta.block_tables.dtype != torch.int32 or meta.seq_lens.dtype != torch.int32:
        return False
    if meta.block_tables.stride(-1) != 1 or not meta.seq_lens.is_contiguous():
        return False
    return _on()


def _on() -> bool:
    """The kernels may run: not TRILLIUM_KERNELS=reference, and the library built. Read per call, as
    dispatch does for CUDA: the switch tests and benchmarks flip."""
    return os.environ.get("TRILLIUM_KERNELS", "") != "reference" and _LIBRARY.available()


def decode_attention(
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
) -> torch.Tensor:
    """q [T, H, D] (one token per sequence, or a verify step's rows) -> out [T, H, D] float32; see the
    module docstring."""
    lib = _LIBRARY.get()
    num_rows, num_heads, head_dim = q.shape
    row_seq, row_lens = (None, meta.seq_lens) if meta.max_query_len == 1 else _verify_rows(meta)
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q heads {num_heads} x {head_dim} do not fit a cache of {num_kv_heads} x {cache_dim}")
    fp8 = k_cache.dtype in FP8_DTYPES
    table = _fp8_table(k_cache.dtype) if fp8 else None
    k_ptr = k_scale.data_ptr() if fp8 and k_scale is not None else None
    v_ptr = v_scale.data_ptr() if fp8 and v_scale is not None else None
    out = torch.empty(num_rows, num_heads, head_dim, dtype=torch.float32)
    rc = lib.trillium_paged_decode_attention(
        q.data_ptr(), num_rows, num_heads, head_dim, q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), None if table is None else table.data_ptr(), block_size,
        num_kv_heads, meta.block_tables.data_ptr(), meta.block_tables.stride(0), row_lens.data_ptr(),
        None if row_seq is None else row_seq.data_ptr(), scale, k_ptr, v_ptr, sliding_window or 0,
        softcap or 0.0, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"paged decode attention refused q {tuple(q.shape)} over a cache {tuple(k_cache.shape)}")
    return out


def prefill_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Can `fresh_prefill_attention` take these (a run's q [T, H, D], k, v [T, KH, D])?"""
    if not (q.dtype == k.dtype == v.dtype == torch.float32) or q.device.type != "cpu":
        return False
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    return _prefill_shape(q.shape[1], k.shape[1], q.shape[2]) and _on()


def _prefill_shape(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Heads and head dim the prefill kernels take (the C file's PF_MAX_G, PF_MAX_D and vector width)."""
    return not (num_heads % num_kv_heads or num_heads // num_kv_heads > PREFILL_MAX_GROUP or head_dim % 16
                or head_dim > 256)


PREFILL_MAX_GROUP = 16  # query heads per KV head the prefill kernel takes (PF_MAX_G)


def fresh_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, q_len: int,
                            scale: float) -> torch.Tensor | None:
    """Causal attention of `num_seqs` sequences of `q_len` consecutive rows, each over its own keys (a
    context-free prefill run, fresh_prefill.py): q [T, H, D], k, v [T, KH, D] -> out [T, H, D] float32.
    The C file's `trillium_fresh_prefill_attention` says how. None where it could not run (no memory
    for its work buffers): the caller takes SDPA."""
    num_rows, num_heads, head_dim = q.shape
    out = torch.empty(num_rows, num_heads, head_dim, dtype=torch.float32)
    rc = _LIBRARY.get().trillium_fresh_prefill_attention(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1), num_seqs, q_len, num_heads, k.shape[1], head_dim, scale,
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out if rc == 0 else None


def context_prefill_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              table: torch.Tensor) -> bool:
    """Can `context_prefill_attention` take one sequence's chunk q [T, H, D] over these caches and its
    block table? (float32 everywhere, contiguous caches, int32 table: fp8 caches keep the reference)"""
    if not (q.dtype == k_cache.dtype == v_cache.dtype == torch.float32) or q.device.type != "cpu":
        return False
    if q.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    if k_cache.device.type != "cpu" or v_cache.shape != k_cache.shape or k_cache.shape[3] != q.shape[2]:
        return False
    if table.dtype != torch.int32 or table.dim() != 1 or table.stride(0) != 1 or table.device.type != "cpu":
        return False
    return _prefill_shape(q.shape[1], k_cache.shape[2], q.shape[2]) and _on()


def context_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                              context: int, scale: float) -> torch.Tensor | None:
    """Causal attention of one sequence's chunk q [T, H, D] at positions context .. context + T - 1 over
    its keys 0 .. context + T - 1 in the paged caches (this chunk's already written), through its block
    table (int32, at least ceil((context + T) / block_size) entries) -> out [T, H, D] float32. The C
    file's `trillium_paged_prefill_attention` says how. None where it could not run (no memory for its
    work buffers): the caller takes SDPA."""
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if table.numel() * block_size < context + num_rows:
        raise ValueError(f"a block table of {table.numel()} blocks of {block_size} does not hold "
                         f"{context + num_rows} keys")
    out = torch.empty(num_rows, num_heads, head_dim, dtype=torch.float32)
    rc = _LIBRARY.get().trillium_paged_prefill_attention(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), block_size, num_kv_heads,
        table.data_ptr(), context, num_rows, num_heads, head_dim, scale, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out if rc == 0 else None


_MIXED_KEY = "paged_attention_cpu.mixed"


def mixed_split(meta: AttentionMetadata) -> tuple | None:
    """A mixed step (decode rows beside prefill chunks): (decode rows, their metadata, the other rows,
    theirs), the decode rows being every sequence of one query row (and, in a verify step, of at most
    MAX_VERIFY_ROWS); None when the step has none of either kind. Once per step (meta.derived).

    WHY: the kernel computes a decode row with its own chunks and summation order; in a mixed step the
    reference would compute the same row in another order, so a request's tokens would depend on
    whether another request was prefilling beside it (greedy output differing between batch sizes)."""
    if _MIXED_KEY in meta.derived:
        return meta.derived[_MIXED_KEY]
    limit = MAX_VERIFY_ROWS if meta.verify_rows else 1
    kernel_seqs = [b for b, n in enumerate(meta.query_lens_list) if n <= limit]
    split = None
    if 0 < len(kernel_seqs) < meta.num_seqs:
        other_seqs = [b for b, n in enumerate(meta.query_lens_list) if n > limit]
        starts = meta.query_start_loc.tolist()
        parts = []
        for seqs in (kernel_seqs, other_seqs):
            rows = torch.tensor([r for b in seqs for r in range(starts[b], starts[b + 1])], dtype=torch.int64)
            parts += [rows, _sub_meta(meta, seqs, rows)]
        split = tuple(parts)
    meta.derived[_MIXED_KEY] = split
    return split


def _sub_meta(meta: AttentionMetadata, seqs: list[int], rows: torch.Tensor) -> AttentionMetadata:
    """The metadata of some of a step's sequences (their rows in `rows`' order)."""
    index = torch.tensor(seqs, dtype=torch.int64)
    qlens = tuple(meta.query_lens_list[b] for b in seqs)
    slens = tuple(meta.seq_lens_list[b] for b in seqs)
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=meta.seq_lens.index_select(0, index).contiguous(),
        block_tables=meta.block_tables.index_select(0, index).contiguous(),
        slot_mapping=meta.slot_mapping.index_select(0, rows),
        max_query_len=max(qlens),
        max_seq_len=max(slens),
        query_lens_list=qlens,
        seq_lens_list=slens,
        verify_rows=meta.verify_rows,
    )


def _verify_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row's table row and key count (row i of a sequence of q rows and length n sees
    n - q + i + 1 keys); once per step, every layer reuses it."""
    rows = meta.derived.get(_ROWS_KEY)
    if rows is None:
        qlens = torch.tensor(meta.query_lens_list, dtype=torch.int64)
        seq = torch.repeat_interleave(torch.arange(len(qlens)), qlens)
        starts = torch.cumsum(qlens, 0) - qlens
        lens = torch.tensor(meta.seq_lens_list, dtype=torch.int64)[seq] - qlens[seq] + 1
        lens += torch.arange(int(qlens.sum())) - starts[seq]
        rows = meta.derived[_ROWS_KEY] = (seq.to(torch.int32), lens.to(torch.int32))
    return rows
