"""Which data-parallel replica serves a request: load with prefix affinity (pure, no trio).

`ReplicaRouter.choose(prompt, ...)` picks a replica index; `started` /
`finished` keep the api's own count of the work each replica holds.

THE RULE (README "Scaling out"):

    score(r)  = pending_tokens(r) + kv_usage(r) * kv_tokens
                pending_tokens: prompt + max_tokens of every unfinished request the api
                sent to r (exact and immediate: SchedulerStats arrive a step late);
                kv_usage: r's latest SchedulerStats (blocks held by running requests,
                cached free blocks count as free), kv_tokens: one replica's KV cache size.
    affinity  = the replica that last took a prompt sharing the longest prefix of full
                blocks with this one (chained hashes of the first AFFINITY_BLOCKS blocks,
                salted with the LoRA id and cache_salt, like the prefix cache's keys),
                and `matched`, the tokens of that shared prefix.
    choose    = the affinity replica if score(affinity) <= min score + matched
                (the work it would carry extra is no more than the prefill it saves),
                else the least-scored replica; ties go to the replica that was sent
                fewest requests so far (sequential requests alternate).

Every prefix hash of the chosen prompt then points at the chosen replica,
so the next turn of a conversation (its prompt starts with this one) lands
where this one's blocks are cached. The table is an LRU of at most
`max_entries` hashes.

WHY hashes of block-aligned prefixes: the engine caches full blocks only, so
a shorter match buys nothing; a shared system prompt matches only its own
blocks, whose saving is small, so it does not pull every conversation onto
one replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

AFFINITY_BLOCKS = 64  # prefix blocks hashed per prompt (a conversation is told apart well before that)
MAX_ENTRIES = 1 << 17


class ReplicaRouter:
    def __init__(self, num_replicas: int, block_size: int, kv_tokens: int, *,
                 max_entries: int = MAX_ENTRIES) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self._block_size = block_size
        self._kv_tokens = kv_tokens
        self._max_entries = max_entries
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica
        self.pending_tokens = [0] * num_replicas
        self.kv_usage = [0.0] * num_replicas
        self.num_routed = [0] * num_replicas  # requests sent to each replica, lifetime
        self.num_affine = 0  # of those, how many followed a cached prefix

    # -- state fed by the api --

    def observe_kv_usage(self, replica: int, kv_usage: float) -> None:
        self.kv_usage[replica] = kv_usage

    def started(self, replica: int, tokens: int) -> None:
        self.pending_tokens[replica] += tokens
        self.num_routed[replica] += 1

    def finished(self, replica: int, tokens: int) -> None:
        self.pending_tokens[replica] = max(0, self.pending_tokens[replica] - tokens)

    def score(self, replica: int) -> float:
        return self.pending_tokens[replica] + self.kv_usage[replica] * self._kv_tokens

    # -- the decision --

    def prefix_hashes(self, prompt: Sequence[int], salt: object = None) -> list[int]:
        """Chained hashes of the prompt's full blocks (the first AFFINITY_BLOCKS)."""
        size = self._block_size
        hashes, previous = [], hash(("trillium-dp", salt))
        for start in range(0, min(len(prompt) // size, AFFINITY_BLOCKS) * size, size):
            previous = hash((previous, tuple(int(t) for t in prompt[start:start + size])))
            hashes.append(previous)
        return hashes

    def affinity(self, hashes: list[int], live: Sequence[int]) -> tuple[int | None, int]:
        """(replica that holds the longest cached prefix among `live`, its length in tokens)."""
        for depth in range(len(hashes), 0, -1):
            replica = self._owner.get(hashes[depth - 1])
            if replica is not None and replica in live:
                return replica, depth * self._block_size
        return None, 0

    def choose(self, prompt: Sequence[int], salt: object = None,
               live: Sequence[int] | None = None) -> tuple[int, list[int]]:
        """(replica, the prompt's prefix hashes to `remember` once it is sent there)."""
        live = list(range(self.num_replicas)) if live is None else list(live)
        if not live:
            raise ValueError("no replica is serving")
        hashes = self.prefix_hashes(prompt, salt)
        least = min(live, key=lambda r: (self.score(r), self.num_routed[r], r))
        sticky, matched = self.affinity(hashes, live)
        if sticky is not None and self.score(sticky) <= self.score(least) + matched:
            self.num_affine += 1
            return sticky, hashes
        return least, hashes

    def remember(self, hashes: list[int], replica: int) -> None:
        owner = self._owner
        for value in hashes:
            owner[value] = replica
            owner.move_to_end(value)
        while len(owner) > self._max_entries:
            owner.popitem(last=False)
