"""Sliding-window attention in the block pool: which blocks a request still reads.

Role: the arithmetic the device BlockPool (block_pool.py) needs for a model
whose every attention layer sees only its last W keys (Mistral, Phi-3,
Qwen2 with `use_sliding_window`): a query at position p reads keys
p - W + 1 .. p, so once a request has computed c tokens the blocks wholly
before position c - W + 1 are never read again. Pure, stateless; no torch.

What the pool does with it (vLLM v1's SlidingWindowManager, vllm-project/vllm
vllm/v1/core/single_type_kv_cache_manager.py): `allocate_slots` first gives
those blocks back to the free queue (`remove_skipped_blocks`) and puts
NULL_BLOCK in their place, so the table keeps its positions::

    W = 6, block_size = 4, c = 13 computed: the next query (13) reads keys 8..13
    request A  ->  [ NULL ][ NULL ][ block 9 ][ block 4 ]
                     freed: still cached, a prefix hit until handed out (as vLLM)

NULL_BLOCK is block 0, reserved for the pool's life when a window is set
(vLLM's `null_block`): zeroed, never handed out, written or registered, so
a kernel that reads it reads finite zeros it masks. The attention kernels
never gather a position behind the window (kernels/reference.py; on CUDA
windowed layers run that reference too, kernels/dispatch.py).

INVARIANT: the executor is not told which positions were freed; its copy of
a running request's table keeps the old ids there, which may by then be
another request's blocks. Nothing reads or writes them: writes go to the
step's new positions, reads stay inside the window.

A freed block keeps its hash and KV until handed out, as every freed block
does, so it may serve later prefix hits. New requests (prefix hits,
swap-ins) get NULL_BLOCK for the positions already behind their window:
those hit blocks are not taken, those lower-tier slots not loaded, those
swapped blocks never saved (scheduler/preemption.py). A prefix hit needs
only the cached run of blocks that fills the window before its end
(`find_hit`), not every block from the first.

Bound: a step of n tokens from position c reads positions c - W + 1 ..
c + n - 1, so a request holds at most ceil((W - 1 + n) / block_size) + 1
blocks at once (`max_blocks`); the scheduler admits a request against
that, not against all its tokens.

Hybrid models (Gemma 2 / 3: some layers global) are not windowed here: one
block table serves every layer and the global ones read every key (vLLM
gives each layer group its own table: its hybrid KV cache manager).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs


@attrs.frozen
class SlidingWindow:
    """W (0: no window, every block is kept) over blocks of `block_size` tokens."""

    window: int
    block_size: int

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks wholly behind the window of the query at `num_computed_tokens`."""
        if not self.window:
            return 0
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def max_blocks(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """Most blocks a request of up to `num_tokens` KV tokens holds at once when no step
        schedules it more than `max_chunk_tokens` (module doc: Bound)."""
        full = -(-num_tokens // self.block_size)
        if not self.window:
            return full
        return min(full, -(-(self.window - 1 + max_chunk_tokens) // self.block_size) + 1)

    def find_hit(self, lookup: Callable, block_hashes: Sequence, max_blocks: int) -> tuple[int, list]:
        """(first, ids): the prefix hit among the first `max_blocks` blocks is blocks
        0 .. first + len(ids) - 1, of which those before `first` need not be held.

        No window: the leading run of cached blocks (first = 0). With one, as
        vLLM's SlidingWindowManager.find_longest_cache_hit: from the right, the
        first run of ceil((W - 1) / block_size) cached blocks, enough for the next
        query's window; failing that the leading run. O(max_blocks) lookups.
        """
        if self.window:
            need = max(1, -(-(self.window - 1) // self.block_size))
            run: list = []  # cached ids, right to left
            for i in range(max_blocks - 1, -1, -1):
                block_id = lookup(block_hashes[i])
                if block_id is None:
                    run = []
                    continue
                run.append(block_id)
                if len(run) >= need:
                    return i, run[::-1]
            return 0, run[::-1]  # the run that reached block 0
        ids = []
        for block_hash in block_hashes[:max_blocks]:
            block_id = lookup(block_hash)
            if block_id is None:
                break
            ids.append(block_id)
        return 0, ids
