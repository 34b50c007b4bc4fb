"""Scheduling policies: waiting-queue order, preemption victims, sibling gating.

A policy owns the waiting queue (requests not running, preempted ones
included) and picks which running request to preempt when blocks run out:

    fcfs      admit by arrival; preempt the most recently admitted request
    priority  admit by (priority, arrival), lower value first, as vLLM;
              preempt the running request with the largest (priority, arrival)

`SiblingGate` holds back the siblings of an n > 1 group until the first one
admitted has computed its prompt, so they find its blocks in the prefix cache.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Iterable, Protocol, Sequence

from trillium.actors.scheduler.request import Request


class SchedulingPolicy(Protocol):
    def __len__(self) -> int: ...

    def add(self, request: Request) -> None:
        """A new arrival."""
        ...

    def push_front(self, requests: Sequence[Request]) -> None:
        """Put requests back ahead of the others, keeping their order: ones
        popped but not admitted this step, and preempted ones."""
        ...

    def pop(self) -> Request: ...

    def remove(self, request: Request) -> None: ...

    def __iter__(self) -> Iterable[Request]: ...

    def pick_victim(self, running: Sequence[Request]) -> Request: ...


class FcfsPolicy:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self):
        return iter(self._queue)

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, requests: Sequence[Request]) -> None:
        self._queue.extendleft(reversed(requests))

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def pick_victim(self, running: Sequence[Request]) -> Request:
        return running[-1]


def _priority_key(request: Request) -> tuple[int, float, int]:
    return (request.priority, request.arrival_time, request.arrival_seq)


class PriorityPolicy:
    def __init__(self) -> None:
        # Entries are (key, request); arrival_seq in the key is unique, so
        # requests themselves are never compared.
        self._heap: list[tuple[tuple[int, float, int], Request]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (r for _, r in sorted(self._heap, key=lambda e: e[0]))

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (_priority_key(request), request))

    def push_front(self, requests: Sequence[Request]) -> None:
        # The key already orders them; a preempted request keeps its arrival.
        for request in requests:
            self.add(request)

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[1] is not request]
        heapq.heapify(self._heap)

    def pick_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=_priority_key)


POLICIES = {"fcfs": FcfsPolicy, "priority": PriorityPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}") from None


class SiblingGate:
    """n > 1 groups: the first sibling admitted leads; the others wait until
    it has sampled its first token (so its full prompt blocks are cached),
    or until it finishes."""

    def __init__(self) -> None:
        self._leaders: dict[str, Request] = {}

    def must_wait(self, request: Request) -> bool:
        if request.group_id is None:
            return False
        leader = self._leaders.get(request.group_id)
        if leader is None or leader is request:
            return False
        # WHY: a first output token means the leader's whole prompt was
        # computed and that step's result cached its full blocks; it stays
        # true through a later preemption of the leader.
        return leader.num_output_tokens == 0

    def admitted(self, request: Request) -> None:
        if request.group_id is not None:
            self._leaders.setdefault(request.group_id, request)

    def finished(self, request: Request) -> None:
        if request.group_id is not None and self._leaders.get(request.group_id) is request:
            # The next sibling admitted leads; blocks the leader cached stay.
            del self._leaders[request.group_id]
