"""Preemption modes: what becomes of a preempted request's KV (`--preemption-mode`).

When a running request cannot get a block, the scheduler preempts running
requests (policy.py picks which) and puts them back at the front of the
waiting queue. Their device blocks are freed either way; the mode decides
what happens to the KV they held:

    recompute  nothing is kept: progress resets to 0 and, re-admitted, the
               request computes its prompt and outputs again (prefix-cache
               hits permitting). Costs compute, needs nothing.
    swap       its computed KV, ceil(num_computed_tokens / block_size) blocks
               (the partial last one included), is copied into host-tier
               slots pinned for it (kv_tiers/host.py `swap_out`), and it keeps
               its num_computed_tokens. Re-admitted, it gets fresh device
               blocks, the copies back are queued (`swap_in`), and it goes on
               where it stopped, with no prefix-cache lookup. Falls back to
               recompute for a request the host tier cannot hold. With a
               sliding window only the blocks inside it travel (block_pool.py).

The copies ride in the batches, like the host tier's eviction saves:

    step N schedule()                            step N execute()
      preempt r: SAVE(r's blocks -> slots)         1. saves: the freed blocks
      pool.free(r): a pop may hand them out           still hold r's KV
                                                   2. loads  3. forward (may reuse them)
    step M schedule()                            step M execute()
      admit r: fresh blocks, LOAD(slots -> them)   1. saves  2. loads: r's KV is back
      the slots come free once M's copies are      3. forward: r computes from
      taken, so no save of step M reuses them         num_computed_tokens on

WHY the saved KV is complete: progress is counted when a step is scheduled
and preemption happens in schedule(), after the previous step's result came
back, so each of a request's num_computed_tokens has its KV in its blocks.

Pure synchronous code: no trio, no zmq, no torch.
"""

from __future__ import annotations

from typing import Protocol

from trillium.actors.kv_tiers.block_pool import BlockId, BlockPool
from trillium.actors.kv_tiers.host import HostTier
from trillium.actors.scheduler.request import Request

PREEMPTION_MODES = ("recompute", "swap")


class Preemption(Protocol):
    """What the scheduler core asks of a preemption mode."""

    num_swapped_out_total: int  # preemptions whose KV went to the host
    num_swapped_in_total: int  # re-admissions that brought it back

    def swap_out(self, request: Request, pool: BlockPool) -> bool: ...

    def is_swapped(self, request: Request) -> bool: ...

    def swap_in(self, request: Request, pool: BlockPool, num_new_tokens: int) -> list[BlockId] | None: ...

    def drop(self, request: Request) -> None: ...

    def drop_all(self) -> list[str]: ...


class RecomputePreemption:
    """Nothing is kept: the scheduler resets a preempted request's progress."""

    num_swapped_out_total = 0
    num_swapped_in_total = 0

    def swap_out(self, request: Request, pool: BlockPool) -> bool:
        return False

    def is_swapped(self, request: Request) -> bool:
        return False

    def swap_in(self, request: Request, pool: BlockPool, num_new_tokens: int) -> list[BlockId] | None:
        raise RuntimeError(f"request {request.request_id}: nothing is swapped out under recompute")

    def drop(self, request: Request) -> None:
        return None

    def drop_all(self) -> list[str]:
        return []


class SwapPreemption:
    """Preempted requests' KV waits in pinned host-tier slots."""

    def __init__(self, host_tier: HostTier) -> None:
        self.host_tier = host_tier
        self.num_swapped_out_total = 0
        self.num_swapped_in_total = 0

    def swap_out(self, request: Request, pool: BlockPool) -> bool:
        """Call before `pool.free(request)`: pin slots for its computed KV and
        queue the saves. False (nothing kept) if the host tier cannot hold it."""
        num_blocks = pool.blocks_needed(request.num_computed_tokens)
        # Sliding window: the blocks behind it are never read again, so neither saved nor loaded.
        skip = pool.num_skipped_blocks(request.num_computed_tokens)
        if num_blocks <= skip:
            return False
        block_ids = pool.block_ids(request.request_id)[skip:num_blocks]
        if not self.host_tier.swap_out(request.request_id, block_ids):
            return False
        self.num_swapped_out_total += 1
        return True

    def is_swapped(self, request: Request) -> bool:
        return self.host_tier.num_swapped_blocks(request.request_id) > 0

    def swap_in(self, request: Request, pool: BlockPool, num_new_tokens: int) -> list[BlockId] | None:
        """Device blocks for a swapped-out request's KV and `num_new_tokens`
        more, its KV queued to load into the leading ones. None, changing
        nothing, if the pool is short."""
        blocks = pool.allocate_slots(request, num_new_tokens)  # from its kept num_computed_tokens
        if blocks is None:
            return None
        num_swapped = self.host_tier.num_swapped_blocks(request.request_id)
        # INVARIANT: num_computed_tokens is what swap_out saw, so the same skip (NULL_BLOCKs lead `blocks`).
        skip = pool.num_skipped_blocks(request.num_computed_tokens)
        self.host_tier.swap_in(request.request_id, blocks[skip : skip + num_swapped])
        self.num_swapped_in_total += 1
        return blocks

    def drop(self, request: Request) -> None:
        """The request finished or was aborted: unpin its slots, if any."""
        self.host_tier.drop_swap(request.request_id)

    def drop_all(self) -> list[str]:
        """Unpin every swapped-out request's slots; returns their ids (the
        scheduler makes them recompute)."""
        request_ids = self.host_tier.swapped_request_ids()
        for request_id in request_ids:
            self.host_tier.drop_swap(request_id)
        return list(request_ids)


def make_preemption(mode: str, host_tier: HostTier | None) -> Preemption:
    if mode == "recompute":
        return RecomputePreemption()
    if mode == "swap":
        if host_tier is None:
            raise ValueError("preemption mode 'swap' keeps preempted requests' KV in the host KV tier: "
                             "it needs one (--kv-host-bytes)")
        return SwapPreemption(host_tier)
    raise ValueError(f"preemption mode must be one of {PREEMPTION_MODES}, got {mode!r}")
