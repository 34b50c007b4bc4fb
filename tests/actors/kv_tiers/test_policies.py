"""Eviction policies of the KV tiers: LRU order, ARC's scan resistance and adaptation."""

import random

import pytest

from trillium.actors.kv_tiers.policies import ARCPolicy, LRUPolicy, make_policy


def run_trace(policy, trace) -> int:
    """A cache of policy.capacity entries driven by `trace`; returns the hits."""
    hits = 0
    for key in trace:
        if key in policy:
            hits += 1
            policy.touch(key)
            continue
        if len(policy) >= policy.capacity:
            evicted = policy.victim(incoming=key)
            assert evicted is not None and evicted not in policy
        policy.insert(key)
        assert len(policy) <= policy.capacity
    return hits


def scan_heavy_trace(seed: int = 0) -> list:
    """A re-used working set (a shared system prompt's blocks) between long one-time scans."""
    rng = random.Random(seed)
    working = [f"w{i}" for i in range(6)]
    trace, fresh = [], 0
    for _ in range(30):
        for _ in range(2):
            trace.extend(rng.sample(working, len(working)))
        trace.extend(f"s{fresh + i}" for i in range(25))
        fresh += 25
    return trace


def test_lru_evicts_the_least_recently_used():
    lru = LRUPolicy(3)
    for key in "abc":
        lru.insert(key)
    lru.touch("a")
    assert lru.victim() == "b"
    lru.insert("d")
    assert lru.victim() == "c"
    lru.remove("a")
    assert lru.victim() == "d" and lru.victim() is None


def test_arc_keeps_the_reused_set_through_scans_where_lru_loses_it():
    trace = scan_heavy_trace()
    lru_hits = run_trace(LRUPolicy(10), trace)
    arc = ARCPolicy(10)
    arc_hits = run_trace(arc, trace)
    working_accesses = sum(1 for k in trace if k.startswith("w"))
    # LRU: every scan flushes the working set, so each round's first pass misses.
    assert arc_hits > lru_hits
    assert arc_hits >= working_accesses - 12, "ARC misses the working set only while it learns it"
    assert all(f"w{i}" in arc for i in range(6)), "the working set is still resident after the last scan"
    assert arc.sizes["t2"] >= 6


def test_arc_grows_t1_when_recently_evicted_keys_come_back():
    arc = ARCPolicy(4)
    arc.insert("x")
    arc.touch("x")  # frequent: T2
    for key in "abc":
        arc.insert(key)
    assert arc.victim(incoming="d") == "a"  # T1 over its target (p = 0): T1's LRU leaves, ghost in B1
    arc.insert("d")
    assert arc.p == 0
    arc.victim(incoming="a")  # make room, then "a" returns from the B1 ghost list
    arc.insert("a")
    assert arc.p > 0, "a recency ghost hit raises T1's target"
    assert "a" in arc and arc.sizes["t2"] == 2  # seen twice: it is frequent now


def test_arc_shrinks_t1_when_frequent_keys_come_back():
    arc = ARCPolicy(4)
    arc.p = 3.0
    for key in "ab":
        arc.insert(key)
        arc.touch(key)  # a and b are frequent (T2)
    for key in "cd":
        arc.insert(key)
    assert arc.victim(incoming="e") == "a", "T1 is within its target: T2's LRU leaves"
    arc.insert("e")
    arc.victim(incoming="a")
    arc.insert("a")  # a frequency ghost hit
    assert arc.p < 3.0


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_random_traces_keep_the_invariants(name):
    rng = random.Random(7)
    policy = make_policy(name, 16)
    trace = [rng.choice(range(60)) if rng.random() < 0.7 else rng.choice(range(8)) for _ in range(3000)]
    run_trace(policy, trace)
    if name == "arc":
        sizes = policy.sizes
        assert sizes["t1"] + sizes["b1"] <= 16
        assert sum(sizes.values()) <= 32
        assert 0 <= policy.p <= 16


def test_unknown_policy_and_bad_capacity_are_refused():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo", 4)
    with pytest.raises(ValueError):
        ARCPolicy(0)
