"""Stop strings of one request, indexed so that each new piece of text costs
what it adds, not what the stop list holds.

`StopMatcher(stops)` is built once per request (the detokenizer's core);
two queries run on every decoded chunk:

    find(text, search_from)   the earliest stop string that ends after `search_from`
                              (ties at the same start: the one listed first)
    hold_back(text)           length of the longest suffix of `text` that is a proper
                              prefix of a stop string (those characters may yet become one)

The idea: a match that the new text completes must end inside it, so only
its end positions are tried. At each end position there is at most one
candidate per distinct stop length, looked up in a dict of the stops of
that length: the work per new character is the number of distinct lengths
(at most --max-stop-string-chars), never the number of stops. For
`hold_back` the stops are kept sorted: the stops that start with a given
suffix form one contiguous run there, found by bisection, and only
suffixes that begin with some stop's first character are tried.

WHY not scan every stop (what it replaces): 10,000 stop strings x n=4 cost
24 ms of detokenizer time per token, which every other request's stream
waited for (ISSUE 16). An Aho-Corasick automaton would do as well per
character but costs a node per stop character in Python objects.

Pure Python, no state beyond the index: safe to share between the choices
of one request.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)  # WHY: "" would match everywhere
        # length -> {stop: its first index in the list}
        self._by_length: dict[int, dict[str, int]] = {}
        for index, stop in enumerate(self.stops):
            self._by_length.setdefault(len(stop), {}).setdefault(stop, index)
        self._lengths = sorted(self._by_length)
        self._sorted = sorted(set(self.stops))
        self._first_chars = frozenset(s[0] for s in self.stops)
        self.max_len = self._lengths[-1] if self._lengths else 0

    def __bool__(self) -> bool:
        return bool(self.stops)

    def find(self, text: str, search_from: int) -> tuple[int, str] | None:
        """(start, stop) of the match that starts earliest among those ending after
        `search_from` (its last character at index >= search_from); None if none."""
        best: tuple[int, int] | None = None  # (start, list index)
        for end in range(max(search_from, 0) + 1, len(text) + 1):
            for length in self._lengths:
                if length > end:
                    break
                start = end - length
                if best is not None and start > best[0]:
                    continue  # WHY: a later start can never win
                index = self._by_length[length].get(text[start:end])
                if index is not None and (best is None or (start, index) < best):
                    best = (start, index)
        return None if best is None else (best[0], self.stops[best[1]])

    def hold_back(self, text: str) -> int:
        """Characters at the end of `text` that may be the start of a stop string."""
        first = max(0, len(text) - self.max_len + 1)
        for start in range(first, len(text)):  # longest suffix first
            if text[start] in self._first_chars and self._is_proper_prefix(text[start:]):
                return len(text) - start
        return 0

    def _is_proper_prefix(self, piece: str) -> bool:
        """Some stop string starts with `piece` and is longer than it."""
        i = bisect.bisect_left(self._sorted, piece)
        for candidate in self._sorted[i:i + 2]:  # `piece` itself may come first
            if len(candidate) > len(piece) and candidate.startswith(piece):
                return True
        return False
