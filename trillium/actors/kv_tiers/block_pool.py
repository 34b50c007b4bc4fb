"""Device KV block pool: paged allocation, ref counts and the prefix cache.

Role: the scheduler's accounting of the executor's KV cache tensors. The
pool never touches memory; it hands out block ids, counts who holds each
block, and remembers which full blocks hold which tokens so a later request
with the same prefix reuses them instead of recomputing them.

State it owns: per-block ref count and hash, the free-block queue, the
prefix index (hash -> block), and each request's block table.

Block layout (block_size = 4, two requests sharing a 2-block prefix)::

    token positions   0  1  2  3 | 4  5  6  7 | 8  9  .  .
    request A  ->  [ block 7    ][ block 2    ][ block 9  ]    (9: partial)
    request B  ->  [ block 7    ][ block 2    ][ block 4  ]
                     ref 2          ref 2        ref 1 each
    hashes           h0 = H(root, t0..t3, lora)
                                   h1 = H(h0, t4..t7, lora)
                                                 (partial blocks are never hashed)

    free queue (evict from the left)                prefix index
      [ 5 | 3 | 8 | 6 | ... ]                        h0 -> 7, h1 -> 2, hX -> 8
        ^ no cached content     ^ least recently freed cached blocks

A freed block keeps its hash and stays findable in the index until it is
handed out again (vLLM v1's design): a prefix hit on a free cached block
takes it back out of the free queue. Blocks are appended to the queue in
reverse order on free, so a request's tail blocks are evicted before its
head blocks (the head is what other requests share). Blocks with no cached
content go to the front: they are worth nothing, so they are reused first.

Hash: SHA-256 over (parent hash, extra key, int64 token ids). Stable across
processes and hosts, so the same hashes can later key host and disk tiers,
and collision-resistant, so a crafted prompt cannot alias another user's KV.
The extra key is the LoRA id (0 = base model), mixed into every block, so
adapters never share blocks. A request's cache salt (vLLM's `cache_salt`)
stands in for the first block's missing parent, H(salt); since every later
block chains from the first, requests with different salts (or none) share
no block at all, in any tier.

Lower tier (optional, kv_tiers/host.py): a slower cache under the device.
The pool tells it about every cached block it evicts (`evicted`), and
`get_computed_blocks` keeps walking the request's hashes in it past the
device hits. Its hits become fresh device blocks in `allocate_slots`,
registered under their hashes at once and queued as loads that the
executor runs before the step's forward. `spill_cached_to_lower` hands it
every cached block at once (a sleep that keeps the prefix cache).

Cost: allocation and freeing are O(blocks touched); the free queue is an
OrderedDict (a C doubly linked list: O(1) pop-front, append, remove).

Sliding window (`sliding_window` W > 0, a model whose every layer sees its
last W keys only): the blocks behind a request's window go back to the free
queue as it advances, NULL_BLOCK in their place (kv_tiers/sliding_window.py).

NOTE on size (~490 lines): the pool, its prefix index and its lower-tier
hooks share the block table and the free queue (the layout above).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import NamedTuple, NewType, Protocol, Sequence

from trillium.actors.kv_tiers.sliding_window import SlidingWindow

BlockId = NewType("BlockId", int)
BlockHash = NewType("BlockHash", bytes)
# The placeholder of a position behind the sliding window (sliding_window.py): reserved when a window is set.
NULL_BLOCK = BlockId(0)


def salt_root(cache_salt: str | None) -> BlockHash | None:
    """The parent hash of a request's first block: None unsalted, else H(salt)."""
    if cache_salt is None:
        return None
    # WHY a domain prefix: the root must never equal a real block's hash.
    return BlockHash(hashlib.sha256(b"trillium-cache-salt\0" + cache_salt.encode()).digest())


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_key: int) -> BlockHash:
    """Chained hash of one full block: H(parent, extra_key, tokens)."""
    h = hashlib.sha256(parent or b"")
    h.update(extra_key.to_bytes(8, "little", signed=True))
    h.update(array("q", token_ids).tobytes())
    return BlockHash(h.digest())


class PoolRequest(Protocol):
    """What the pool reads from a request (the scheduler's Request has it)."""

    request_id: str
    lora_id: int
    cache_salt: str | None
    num_computed_tokens: int
    block_hashes: list[BlockHash]  # hashes of the request's full blocks, in order

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def reads_prefix_cache(self) -> bool: ...


class LowerTier(Protocol):
    """A slower KV tier under the pool (host memory): takes what the device
    evicts, serves prefix hits the device no longer has (kv_tiers/host.py)."""

    def evicted(self, block_id: BlockId, block_hash: BlockHash) -> None: ...

    def lookup(self, block_hashes: Sequence[BlockHash]) -> tuple[int, ...]: ...

    def reserve(self, slots: Sequence[int]) -> None: ...

    def load(self, slot: int, block_id: BlockId) -> None: ...


class PrefixHit(NamedTuple):
    """Leading blocks of a request found in the cache, and the tokens they hold:
    device blocks, then the lower tier's slots of the blocks that follow them
    (num_computed_tokens counts both)."""

    block_ids: tuple[BlockId, ...]
    num_computed_tokens: int
    lower_slots: tuple[int, ...] = ()


NO_HIT = PrefixHit((), 0)


class PrefixIndex:
    """hash -> block id of cached full blocks, with hit counters in tokens."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._blocks: dict[BlockHash, BlockId] = {}
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def extend_block_hashes(self, request: PoolRequest) -> None:
        """Append hashes for the request's full blocks not hashed yet."""
        hashes, tokens, size = request.block_hashes, request.all_token_ids, self.block_size
        parent = hashes[-1] if hashes else salt_root(request.cache_salt)
        for start in range(len(hashes) * size, len(tokens) - size + 1, size):
            parent = hash_block_tokens(parent, tokens[start : start + size], request.lora_id)
            hashes.append(parent)

    def lookup(self, block_hash: BlockHash) -> BlockId | None:
        return self._blocks.get(block_hash)

    def insert(self, block_hash: BlockHash, block_id: BlockId) -> bool:
        """Register a block; False if the hash is already cached elsewhere."""
        if block_hash in self._blocks:
            return False
        self._blocks[block_hash] = block_id
        return True

    def discard(self, block_hash: BlockHash, block_id: BlockId) -> None:
        if self._blocks.get(block_hash) == block_id:
            del self._blocks[block_hash]

    def clear(self) -> int:
        num = len(self._blocks)
        self._blocks.clear()
        return num

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens


class DisabledPrefixIndex(PrefixIndex):
    """Prefix caching off: nothing is hashed, found or registered."""

    def extend_block_hashes(self, request: PoolRequest) -> None:
        return None

    def lookup(self, block_hash: BlockHash) -> BlockId | None:
        return None

    def insert(self, block_hash: BlockHash, block_id: BlockId) -> bool:
        return False

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        return None


class BlockPool:
    """Fixed set of `num_blocks` KV blocks of `block_size` tokens each."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 lower_tier: LowerTier | None = None, sliding_window: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        if sliding_window < 0 or (sliding_window and num_blocks < 2):
            raise ValueError(f"sliding_window {sliding_window} needs a window >= 0 and >= 2 blocks (one is NULL_BLOCK)")
        if lower_tier is not None and not enable_prefix_caching:
            raise ValueError("a lower KV tier is keyed by block hashes: it needs prefix caching")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._index = PrefixIndex(block_size) if enable_prefix_caching else DisabledPrefixIndex(block_size)
        self._lower = lower_tier
        # Lifetime totals, in blocks: device prefix hits at admission, cached blocks evicted.
        self.num_hit_blocks = 0
        self.num_evicted_blocks = 0
        self._ref_cnt = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        # INVARIANT: a block is in _free iff its ref count is 0.
        self._free: OrderedDict[BlockId, None] = OrderedDict((BlockId(b), None) for b in range(num_blocks))
        self.sliding_window = sliding_window
        self._window = SlidingWindow(sliding_window, block_size)
        if sliding_window:  # NULL_BLOCK: held for good (ref 1), never in the free queue
            del self._free[NULL_BLOCK]
            self._ref_cnt[NULL_BLOCK] = 1
        # Blocks requests can hold: all but NULL_BLOCK when it is reserved.
        self.num_usable_blocks = num_blocks - (1 if sliding_window else 0)
        self._req_blocks: dict[str, list[BlockId]] = {}
        self._req_num_cached_blocks: dict[str, int] = {}

    # -- read-only views ------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    @property
    def prefix_cache_query_tokens(self) -> int:
        return self._index.num_query_tokens

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return self._index.num_hit_tokens

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._hash[block_id] is not None

    def block_ids(self, request_id: str) -> tuple[BlockId, ...]:
        return tuple(self._req_blocks.get(request_id, ()))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks behind the window of the next token (0 without one)."""
        return self._window.num_skipped_blocks(num_computed_tokens)

    def max_blocks_for(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """Most blocks a request of up to `num_tokens` KV tokens holds at once,
        scheduled at most `max_chunk_tokens` a step."""
        return self._window.max_blocks(num_tokens, max_chunk_tokens)

    # -- prefix cache ---------------------------------------------------

    def update_block_hashes(self, request: PoolRequest) -> None:
        """Hash the request's newly full blocks (call after tokens are appended)."""
        self._index.extend_block_hashes(request)

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        """Number of leading blocks of this hash chain held in the cache."""
        num = 0
        for block_hash in block_hashes:
            if self._index.lookup(block_hash) is None:
                break
            num += 1
        return num

    def get_computed_blocks(self, request: PoolRequest) -> PrefixHit:
        """Longest cached prefix of a request that is not running yet.

        Never the whole request: the last token must be computed so its
        position produces logits, so only blocks that end at or before
        num_tokens - 1 are looked up (a fully cached prompt backs off by one
        block). Past the device's hits the walk goes on in the lower tier.
        Pure lookup: nothing is taken until `allocate_slots`. With a window
        the leading blocks may be NULL_BLOCK (sliding_window.py `find_hit`).
        """
        if not request.reads_prefix_cache:
            return NO_HIT
        max_blocks = (request.num_tokens - 1) // self.block_size
        # With a window: the rightmost run of cached blocks that fills it, NULL before it (vLLM).
        first, found = self._window.find_hit(self._index.lookup, request.block_hashes, max_blocks)
        found = [NULL_BLOCK] * first + found
        slots: tuple[int, ...] = ()
        if self._lower is not None and len(found) < max_blocks:
            rest = request.block_hashes[len(found) : max_blocks]
            slots = self._lower.lookup(rest)
            # WHY stop at a block the device holds again: lower-tier hits load into
            # fresh blocks after the device hits; a mixed chain is rare (another
            # request recomputed a later block) and not worth the bookkeeping.
            for k in range(len(slots)):
                if self._index.lookup(rest[k]) is not None:
                    slots = slots[:k]
                    break
        return PrefixHit(tuple(found), (len(found) + len(slots)) * self.block_size, slots)

    def cache_full_blocks(self, request: PoolRequest, num_tokens: int | None = None) -> int:
        """Register the request's blocks that are full of computed tokens (of its first
        `num_tokens`; default all its computed tokens).

        Call once the step that computed them has returned, so a cached block
        always holds its KV (with steps still in flight, pass the tokens whose
        step came back). Returns the number of blocks newly registered.
        """
        computed = request.num_computed_tokens if num_tokens is None else min(num_tokens, request.num_computed_tokens)
        return len(self._register(request, computed))

    def cache_scheduled_blocks(self, request: PoolRequest, num_tokens: int) -> list[BlockId]:
        """Register now the request's full blocks whose tokens are all among its first
        `num_tokens`, the tokens computed once the step being planned has run (same-step
        sharing: a request admitted later in this step, or a later step, hits them).
        Returns the blocks newly registered, for `uncache` if the request leaves the plan.

        WHY before the step runs (vLLM v1 caches blocks in allocate_slots, block_pool.py
        cache_full_blocks): in a step's forward every layer writes all rows' K/V into the
        paged cache before any row's attention reads it (models/kv_cache.py
        `KvCache.attend`), so a row may attend to KV another row of its step writes. A
        cached block is one whose KV is written by the time any step that reads it runs
        (steps run in order). A block only partly scheduled (a prefill chunk's tail) is
        not full of scheduled tokens and waits; placeholder and draft positions carry no
        hash (`block_hashes` covers known tokens only), so they are never registered.
        """
        return self._register(request, num_tokens)

    def uncache(self, block_ids: Sequence[BlockId]) -> None:
        """Forget blocks `cache_scheduled_blocks` registered for a plan that then dropped
        their request (preempted while the step was planned): their KV will never be written.
        INVARIANT: called before the request frees them, while no other request holds them."""
        for block_id in block_ids:
            block_hash = self._hash[block_id]
            if block_hash is not None:
                self._index.discard(block_hash, block_id)
                self._hash[block_id] = None

    def _register(self, request: PoolRequest, num_tokens: int) -> list[BlockId]:
        """Index the request's not yet registered blocks full of its first `num_tokens` tokens."""
        rid = request.request_id
        blocks = self._req_blocks.get(rid)
        if blocks is None:
            return []
        done = self._req_num_cached_blocks[rid]
        upto = min(max(0, num_tokens) // self.block_size, len(request.block_hashes), len(blocks))
        registered = []
        for i in range(done, upto):
            block_id = blocks[i]
            if self.sliding_window and block_id == NULL_BLOCK:
                continue  # behind the window before it was registered: its KV is gone
            # WHY: a duplicate of an already-cached block (two requests computed
            # the same prefix at once) stays unregistered and is reused first.
            if self._hash[block_id] is None and self._index.insert(request.block_hashes[i], block_id):
                self._hash[block_id] = request.block_hashes[i]
                registered.append(block_id)
        self._req_num_cached_blocks[rid] = max(done, upto)
        return registered

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (e.g. after a weight update). Blocks in use
        stay with their requests but are never found again. Returns the number
        of cache entries dropped. O(num_blocks): an admin operation."""
        for block_id in range(self.num_blocks):
            self._hash[block_id] = None
        # NOTE: _req_num_cached_blocks is left as is, so running requests do not
        # re-register blocks computed before the reset.
        return self._index.clear()

    def spill_cached_to_lower(self) -> int:
        """Hand every cached block to the lower tier (`evicted`), then forget
        them here as `reset_prefix_cache` does: the device KV is about to be
        freed (sleep that keeps the prefix cache). The lower tier keeps what
        it has room for. Free blocks go in eviction order, blocks still in
        use after them, so when the lower tier is full the blocks it would
        keep anyway (request heads, recently used) survive. Returns the
        number of blocks handed down. O(num_blocks): an admin operation."""
        if self._lower is None:
            raise RuntimeError("no lower KV tier to spill the prefix cache to")
        in_use = (b for b in range(self.num_blocks) if self._ref_cnt[b] > 0)
        num = 0
        for block_id in (*self._free, *in_use):
            block_hash = self._hash[block_id]
            if block_hash is not None:
                self._lower.evicted(BlockId(block_id), block_hash)
                num += 1
        self.reset_prefix_cache()
        return num

    # -- allocation -----------------------------------------------------

    def allocate_slots(
        self, request: PoolRequest, num_new_tokens: int, prefix_hit: PrefixHit = NO_HIT
    ) -> list[BlockId] | None:
        """Give the request enough blocks for `num_new_tokens` more tokens.

        `prefix_hit` (from get_computed_blocks, only on admission) is taken
        first: its blocks join the request's table and its tokens count as
        computed; its lower-tier hits get fresh blocks, registered in the
        cache and queued as loads. Returns the block ids appended to the
        request's table (hit blocks, loaded ones, then fresh ones), or None,
        changing nothing else, if the free queue is too short. With a window,
        a running request's blocks behind it are freed first (module doc) and
        a new request's positions behind it are NULL_BLOCK.
        """
        rid = request.request_id
        held = self._req_blocks.get(rid)
        is_new = held is None
        if not is_new:
            self.remove_skipped_blocks(request)
        num_computed = request.num_computed_tokens + prefix_hit.num_computed_tokens
        num_tokens = num_computed + num_new_tokens
        # Positions behind the window on arrival (always 0 for a running request: freed above).
        skip = self.num_skipped_blocks(num_computed) if is_new else 0
        num_hits, slots = len(prefix_hit.block_ids), prefix_hit.lower_slots
        hits = prefix_hit.block_ids[skip:]
        kept_slots = slots[max(0, skip - num_hits):]
        num_held = (0 if held is None else len(held)) + num_hits + len(slots)
        num_positions = max(0, self.blocks_needed(num_tokens) - num_held)  # fresh positions
        num_null = max(0, skip - num_held)  # fresh positions behind the window (a swap-in)
        num_fresh = num_positions - num_null
        # Hit blocks with ref 0 sit in the free queue: taking them shrinks it.
        num_revived = sum(1 for b in hits if self._ref_cnt[b] == 0)
        if num_fresh + num_revived + len(kept_slots) > len(self._free):
            return None
        for block_id in hits:
            if self._ref_cnt[block_id] == 0:
                del self._free[block_id]
            self._ref_cnt[block_id] += 1
        added = [NULL_BLOCK] * (num_hits - len(hits)) + list(hits)
        if slots:
            added.extend([NULL_BLOCK] * (len(slots) - len(kept_slots)))
            added.extend(self._load_from_lower(request, kept_slots, num_hits + len(slots) - len(kept_slots)))
        added.extend([NULL_BLOCK] * num_null)
        added.extend(self._pop_free() for _ in range(num_fresh))
        if is_new:
            self._req_blocks[rid] = added.copy()
            self._req_num_cached_blocks[rid] = num_hits + len(slots)
            if request.reads_prefix_cache:
                self._index.record_query(request.num_tokens, prefix_hit.num_computed_tokens)
                self.num_hit_blocks += len(hits)
        else:
            held.extend(added)
        return added

    def remove_skipped_blocks(self, request: PoolRequest) -> int:
        """Free the running request's blocks wholly behind its window (by its
        num_computed_tokens), NULL_BLOCK in their place; returns how many.
        No-op without a window. Cost: O(blocks freed) (stops at the first NULL)."""
        blocks = self._req_blocks.get(request.request_id)
        if not self.sliding_window or not blocks:
            return 0
        released = []
        # INVARIANT: positions behind the window are freed in order, so the
        # NULLs form a prefix of the table: walking back from the window stops at one.
        for i in range(min(self.num_skipped_blocks(request.num_computed_tokens), len(blocks)) - 1, -1, -1):
            if blocks[i] == NULL_BLOCK:
                break
            released.append(blocks[i])
            blocks[i] = NULL_BLOCK
        self._release(released)  # last index first, as `free` (tail first)
        return len(released)

    def free(self, request: PoolRequest) -> None:
        """Drop the request's hold on its blocks (tail first, see module doc)."""
        blocks = self._req_blocks.pop(request.request_id, None)
        self._req_num_cached_blocks.pop(request.request_id, None)
        self._release(reversed(blocks or ()))

    def _release(self, block_ids) -> None:
        for block_id in block_ids:
            if self.sliding_window and block_id == NULL_BLOCK:
                continue
            self._ref_cnt[block_id] -= 1
            if self._ref_cnt[block_id] == 0:
                self._free[block_id] = None
                if self._hash[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    def trim(self, request: PoolRequest, num_tokens: int) -> int:
        """Free the request's blocks past the first `num_tokens` tokens (speculative
        decoding: blocks that held only rejected drafts). They were allocated fresh
        for this step and never cached. Returns the number freed."""
        blocks = self._req_blocks.get(request.request_id)
        if blocks is None:
            return 0
        keep = self.blocks_needed(num_tokens)
        extra = blocks[keep:]
        del blocks[keep:]
        self._release(reversed(extra))
        self._req_num_cached_blocks[request.request_id] = min(self._req_num_cached_blocks[request.request_id], keep)
        return len(extra)

    def _load_from_lower(self, request: PoolRequest, slots: Sequence[int], first: int) -> list[BlockId]:
        """Fresh blocks for the lower tier's hits `slots` (block `first` on),
        cached under their hashes now (their content arrives before the step's forward)."""
        assert self._lower is not None and request.request_id not in self._req_blocks
        # WHY reserve first: popping a block may evict one to the lower tier,
        # which must not pick a slot this request is about to load from.
        self._lower.reserve(slots)
        loaded = []
        for k, slot in enumerate(slots):
            block_id = self._pop_free()
            block_hash = request.block_hashes[first + k]
            if self._index.insert(block_hash, block_id):
                self._hash[block_id] = block_hash
            self._lower.load(slot, block_id)
            loaded.append(block_id)
        return loaded

    def _pop_free(self) -> BlockId:
        block_id, _ = self._free.popitem(last=False)
        block_hash = self._hash[block_id]
        if block_hash is not None:  # evict: its content is about to be overwritten
            self._index.discard(block_hash, block_id)
            self._hash[block_id] = None
            self.num_evicted_blocks += 1
            if self._lower is not None:
                # NOTE: the block still holds its KV until the step it was popped
                # for runs; the executor copies it out first thing in that step.
                self._lower.evicted(block_id, block_hash)
        self._ref_cnt[block_id] = 1
        return block_id
