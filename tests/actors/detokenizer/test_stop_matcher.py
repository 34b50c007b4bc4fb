"""StopMatcher against the plain scan it replaces, on random texts and stop lists.

The oracle is the definition: the earliest-starting stop string whose last
character lies at or after `search_from` (ties: the one listed first, as
vLLM takes the first listed that matches: vllm/v1/engine/detokenizer.py
`check_stop_strings`), and the longest suffix that is a proper prefix of a
stop string (vLLM holds back up to len(longest stop) - 1 characters).
"""

from __future__ import annotations

import random

import pytest

from trillium.actors.detokenizer.stop_matcher import StopMatcher


def _find_oracle(text, search_from, stops):
    best = None
    for stop in stops:
        index = text.find(stop, max(0, search_from - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def _hold_back_oracle(text, stops):
    return max((n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)


@pytest.mark.parametrize("seed", range(40))
def test_matches_the_plain_scan(seed):
    rng = random.Random(seed)
    alphabet = "ab c" if seed % 2 else "abcdefgh é"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 12))]
    matcher = StopMatcher(stops)
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        search_from = rng.randint(0, len(text))
        assert matcher.find(text, search_from) == _find_oracle(text, search_from, stops), (text, search_from, stops)
        assert matcher.hold_back(text) == _hold_back_oracle(text, stops), (text, stops)


def test_ties_and_empty_strings():
    matcher = StopMatcher(["", "bc", "abc", "b"])
    assert matcher.find("xabc", 3) == (1, "abc")  # earliest start wins over the shorter "bc"
    assert StopMatcher(["b", "bc"]).find("abc", 2) == (1, "bc")  # "b" ends before search_from
    assert StopMatcher(["bc", "b"]).find("abc", 1) == (1, "bc")  # same start: listed first
    assert not StopMatcher([""]) and StopMatcher([""]).find("abc", 0) is None


def test_work_does_not_grow_with_the_number_of_stops():
    """10,000 stops of one length: one dict lookup per new character and length."""
    stops = [f"stop-{i:05d}" for i in range(10_000)]
    matcher = StopMatcher(stops)
    assert matcher.find("text then stop-09999", 14) == (10, "stop-09999")
    assert matcher.hold_back("text then stop-0") == len("stop-0")
    assert len(matcher._lengths) == 1
