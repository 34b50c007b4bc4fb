"""The DetokenizeSpec of an n > 1 request crosses to the detokenizer once.

Each choice's first RequestDelta carries its DetokenizeSpec (prompt ids,
stop strings, ...) and, for a choice of an n > 1 request, its `group_id`.
The choices of one request share one spec, so `GroupSpecs.once(deltas)`,
applied to every TokenDeltas on its way to the detokenizer, keeps the spec
on the first such delta of each group that goes out and drops it from the
group's later ones (the detokenizer keeps the spec until `num_choices`
first deltas took it: actors/detokenizer/core.py).

WHY at sending time, in the order sent: the loop may send an abort's delta
(created earlier) after a step's deltas (created later); whichever goes
first must be the one with the spec. WHY it matters: 10,000 stop strings x
n=4 copied per choice made +313 MB in the scheduler for one 2.2 MB request
(ISSUE 16).

State: groups whose spec went out, with the first deltas still to come.
Pure: no trio, no zmq.
"""

from __future__ import annotations

import attrs

from trillium.actors.protocol.outputs import TokenDeltas


class GroupSpecs:
    def __init__(self) -> None:
        self._remaining: dict[str, int] = {}  # group id -> choices whose first delta is still to go

    def __len__(self) -> int:
        return len(self._remaining)

    def once(self, message: TokenDeltas) -> TokenDeltas:
        deltas = list(message.deltas)
        changed = False
        for i, delta in enumerate(deltas):
            if delta.spec is None or delta.group_id is None:
                continue
            group = delta.group_id
            remaining = self._remaining.get(group)
            if remaining is None:  # the group's first delta to go out keeps the spec
                if delta.spec.num_choices > 1:
                    self._remaining[group] = delta.spec.num_choices - 1
                continue
            deltas[i] = attrs.evolve(delta, spec=None)
            changed = True
            if remaining <= 1:
                del self._remaining[group]
            else:
                self._remaining[group] = remaining - 1
        return attrs.evolve(message, deltas=tuple(deltas)) if changed else message
