"""Eviction policies for a KV cache tier: which cached block leaves first.

A tier (host memory, disk) holds up to `capacity` blocks keyed by their
prefix hash. It tells its policy what happens to each key and asks it for a
victim when it needs room:

    policy.insert(key)             a block was stored (after a miss)
    policy.touch(key)              a stored block was hit
    policy.remove(key)             the tier dropped it for another reason (corrupt file, promoted)
    policy.victim(incoming) -> key the resident block to evict so `incoming` fits (it is
                                   forgotten as resident; the tier then drops the block)

Two policies behind that Protocol, chosen by `--kv-eviction-policy`:

- `LRUPolicy`: least recently inserted or hit first.
- `ARCPolicy`: Megiddo & Modha's Adaptive Replacement Cache. Residents are
  split into T1 (seen once recently) and T2 (seen at least twice); ghost
  lists B1 / B2 remember the keys recently evicted from each. A miss whose
  key is in B1 means T1 was too small: the target size `p` of T1 grows; a
  miss found in B2 shrinks it. So a scan of one-time keys (a long document
  read once) only churns T1 and leaves the re-used prefixes (system
  prompts, conversation heads) in T2, where LRU would flush them.

Pure Python, no I/O: each tier owns one policy instance and calls it under
its own lock (or from its single owner task).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Protocol

Key = Hashable


class EvictionPolicy(Protocol):
    capacity: int

    def insert(self, key: Key) -> None: ...

    def touch(self, key: Key) -> None: ...

    def remove(self, key: Key) -> None: ...

    def victim(self, incoming: Key | None = None) -> Key | None: ...

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...


class LRUPolicy:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, incoming: Key | None = None) -> Key | None:
        if not self._order:
            return None
        key, _ = self._order.popitem(last=False)
        return key

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


class ARCPolicy:
    """ARC over `capacity` residents; `p` is the adaptive target size of T1."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.p = 0.0
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()

    # -- what the tier reports ------------------------------------------

    def insert(self, key: Key) -> None:
        """A block was stored after a miss; a ghost hit adapts `p` and goes to T2."""
        if key in self._t1 or key in self._t2:
            self.touch(key)
            return
        if key in self._b1:
            self.p = min(float(self.capacity), self.p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def touch(self, key: Key) -> None:
        """A hit: a key seen twice moves to (the MRU end of) T2."""
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def victim(self, incoming: Key | None = None) -> Key | None:
        """ARC's REPLACE: evict from T1 while it exceeds its target `p`, else from T2.
        The victim is remembered in the matching ghost list."""
        if not self._t1 and not self._t2:
            return None
        from_t1 = bool(self._t1) and (
            len(self._t1) > self.p or (incoming in self._b2 and len(self._t1) == int(self.p)) or not self._t2
        )
        if from_t1:
            key, _ = self._t1.popitem(last=False)
            self._b1[key] = None
        else:
            key, _ = self._t2.popitem(last=False)
            self._b2[key] = None
        self._trim_ghosts()
        return key

    # -- views ------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    @property
    def sizes(self) -> dict[str, int]:
        return {"t1": len(self._t1), "t2": len(self._t2), "b1": len(self._b1), "b2": len(self._b2)}

    def _trim_ghosts(self) -> None:
        # Directory bounds: |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c.
        c = self.capacity
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while (self._b1 or self._b2) and len(self) + len(self._b1) + len(self._b2) > 2 * c:
            (self._b2 if self._b2 else self._b1).popitem(last=False)


POLICIES = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    try:
        return POLICIES[name](capacity)
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {sorted(POLICIES)}") from None
