"""Sliding-window models: the KV blocks behind the window are freed as requests advance (pure, fast).

Mirrors vLLM v1's SlidingWindowManager (vllm-project/vllm
vllm/v1/core/single_type_kv_cache_manager.py): `remove_skipped_blocks` frees
the blocks wholly before num_computed_tokens - W + 1 and puts the pool's
null block (block 0) in their place; a freed block stays cached (findable)
until it is handed out again, as every freed block in vllm/v1/core/block_pool.py.

The fake executor (support/fake_executor.py) with `sliding_window` set reads
and owns only the positions a windowed query reads, so a freed block handed
to another request while a stale id still names it, a NULL_BLOCK where KV is
needed, or a lost swap copy fails an assertion or changes the tokens
(compared with `reference`, which never sees the scheduler).
"""

from __future__ import annotations

import random

import attrs
import pytest

from support.fake_executor import reference
from support.fake_executor import TieredFakeExecutor
from support.pool_requests import FakeRequest, admit, check_invariants
from support.scheduler_harness import Harness
from trillium.actors.kv_tiers.block_pool import NULL_BLOCK, BlockPool
from trillium.actors.kv_tiers.host import HostTier
from trillium.actors.kv_tiers.manager import KvTierManager
from trillium.actors.scheduler.core import Scheduler

W, BS = 8, 4  # the query at p reads keys p - 7 .. p: at most ceil(7 / 4) + 1 = 3 blocks while decoding


class HostHarness(Harness):
    """The harness over a host KV tier, swap preemption by default (as test_swap_preemption.py)."""

    def __init__(self, preemption_mode: str = "swap", **config) -> None:
        super().__init__(**config)
        self.tier = HostTier(64, block_bytes=8)
        config = attrs.evolve(self.sched.config, preemption_mode=preemption_mode)
        self.sched = Scheduler(config, kv_tiers=KvTierManager(self.tier, config.block_size))
        self.ex = TieredFakeExecutor(config.num_blocks, config.block_size, 64)
        self.ex.sliding_window = config.sliding_window


def live_blocks(h: Harness, rid: str) -> list[int]:
    return [b for b in h.sched.pool.block_ids(rid) if b != NULL_BLOCK]


def check(h: Harness, msg, max_model_len: int) -> None:
    expected, reason, _ = reference(msg.prompt_token_ids.tolist(), msg.sampling, (), 0, max_model_len)
    assert h.tokens(msg.request_id) == expected and h.final(msg.request_id)[0] == reason


def test_decode_holds_a_window_of_blocks_and_a_long_request_fits_a_small_cache():
    config = dict(num_blocks=8, block_size=BS, max_model_len=400, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="KV blocks"):  # without the window: 30 blocks, the cache has 8
        Harness(**config).add("a", range(1, 21), max_tokens=100, ignore_eos=True)
    h = Harness(sliding_window=W, **config)
    msg = h.add("a", range(1, 21), max_tokens=100, ignore_eos=True)
    held = []
    while h.sched.has_work():
        batch = h.step()
        request = h.sched.get_request("a")
        if request is not None and request.num_output_tokens > 1:
            held.append(len(live_blocks(h, "a")))
            table = h.sched.pool.block_ids("a")
            assert len(table) * BS >= request.num_computed_tokens  # positions kept, NULL in front
            assert set(table[: len(table) - held[-1]]) == {NULL_BLOCK}
        assert batch is not None
    check(h, msg, 400)
    assert max(held) <= 3 and h.sched._num_preempted_total == 0
    assert h.sched.pool.num_free_blocks == 7  # all back; block 0 is the reserved NULL_BLOCK


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_tight_cache_with_freeing(mode):
    """Three long requests, 9 usable blocks: they cannot all hold their window; preempted ones
    recompute (or swap only their window's blocks out and back) and still produce their tokens."""
    config = dict(num_blocks=10, block_size=BS, max_model_len=200, max_num_batched_tokens=8, sliding_window=W)
    h = HostHarness(**config) if mode == "swap" else Harness(**config)
    msgs = [h.add(rid, range(10 * i + 1, 10 * i + 15), max_tokens=60, ignore_eos=True) for i, rid in enumerate("abc")]
    h.run()
    for msg in msgs:
        check(h, msg, 200)
    assert h.sched._num_preempted_total > 0
    if mode == "swap":
        assert h.sched._preemption.num_swapped_in_total > 0
        # Only blocks inside the window travel: each swap saves at most the 3 it reads.
        assert max(len(b.kv.save_block_ids) for b in h.batches) <= 3 * len(msgs)
    assert h.sched.pool.num_free_blocks == 9


def test_prefix_hit_past_the_window_takes_only_the_window():
    """A freed block stays cached until handed out (as vLLM): a later request with the same
    prefix hits it; the hit blocks behind its window are not taken (NULL_BLOCK)."""
    h = Harness(num_blocks=64, block_size=BS, max_model_len=200, max_num_batched_tokens=64, sliding_window=W)
    first = h.add("a", range(1, 41), max_tokens=3, ignore_eos=True)
    h.run()
    assert h.sched.pool.num_cached_blocks >= 10  # every full block registered before it was freed
    second = h.add("b", list(range(1, 41)) + [7, 8], max_tokens=5, ignore_eos=True)
    h.step()
    request = h.sched.get_request("b")
    assert request.num_cached_tokens == 40
    table = h.sched.pool.block_ids("b")
    assert table[:8] == (NULL_BLOCK,) * 8 and NULL_BLOCK not in table[8:]  # 40 - 8 + 1 = 33: from block 8 on
    h.run()
    check(h, first, 200)
    check(h, second, 200)


@pytest.mark.parametrize("host_tier", [False, True])
def test_prefix_hit_needs_only_the_window_once_the_head_is_evicted(host_tier):
    """The blocks behind the window are freed first, so under pressure they are evicted first:
    the leading chain breaks at block 0, yet the cached run that fills the window before the
    prompt's end is a hit (vLLM's find_longest_cache_hit searches from the right). With a host
    tier a longer filler evicts every device block to it, and only the 2 blocks inside the
    window are loaded back."""
    config = dict(num_blocks=16, block_size=BS, max_model_len=200, max_num_batched_tokens=8, sliding_window=W)
    h = HostHarness(preemption_mode="recompute", **config) if host_tier else Harness(**config)
    prompt = list(range(1, 41))
    first = h.add("a", prompt, max_tokens=2, ignore_eos=True)
    h.run()
    filler = h.add("f", range(100, 170 if host_tier else 130), max_tokens=2, ignore_eos=True)
    h.run()
    again = h.add("b", prompt + [7, 8], max_tokens=4, ignore_eos=True)
    request = h.sched.get_request("b")
    assert h.sched.pool.match_prefix(request.block_hashes) == 0  # block 0 is gone from the device
    h.step()
    assert request.num_cached_tokens == 40  # 40 - 8 + 1 = 33: blocks 8 and 9 are all it reads
    assert h.sched.pool.block_ids("b")[:8] == (NULL_BLOCK,) * 8
    assert len(h.batches[-1].kv.load_block_ids) == (2 if host_tier else 0)
    h.run()
    for msg in (first, filler, again):
        check(h, msg, 200)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_load_with_shared_prefixes(mode, seed):
    """Requests sharing prefixes arrive while others run on a small cache: prefix hits past the
    window, freeing, preemption and (swap) host copies all interleave; every output is exact."""
    rng = random.Random(seed)
    config = dict(num_blocks=14, block_size=BS, max_model_len=120, max_num_batched_tokens=12, sliding_window=W)
    h = HostHarness(preemption_mode=mode, **config)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randint(10, 40))] for _ in range(2)]
    msgs = []
    for i in range(10):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randint(1, 9))]
        msgs.append(h.add(f"r{i}", prompt, max_tokens=rng.randint(5, 40), ignore_eos=True))
        for _ in range(rng.randint(0, 6)):
            h.step()
    h.run()
    for msg in msgs:
        check(h, msg, 120)
    assert h.sched._num_preempted_total > 0 and h.sched.pool.num_free_blocks == 13
    assert h.sched.pool.prefix_cache_hit_tokens > 0 and sum(len(b.kv.load_block_ids) for b in h.batches) > 0
    assert (h.sched._preemption.num_swapped_in_total > 0) == (mode == "swap")


def test_pool_accounting_with_a_window():
    pool = BlockPool(12, BS, sliding_window=W)
    assert pool.num_usable_blocks == 11 and pool.num_free_blocks == 11 and pool.ref_count(NULL_BLOCK) == 1
    a = FakeRequest("a", range(1, 30))
    admit(pool, a)  # 29 tokens computed: the next query (29) reads 22..29, blocks 5..7
    assert pool.allocate_slots(a, 1) == []
    assert pool.block_ids("a")[:5] == (NULL_BLOCK,) * 5 and pool.num_free_blocks == 11 - 3
    assert pool.max_blocks_for(1000, max_chunk_tokens=1) == 3  # ceil((8 - 1 + 1) / 4) + 1
    assert pool.max_blocks_for(10, max_chunk_tokens=64) == 3  # never more than every token needs
    b = FakeRequest("b", range(1, 30))
    hit = admit(pool, b, compute=False)  # its hit: blocks 0..6 cached, 0..4 behind the window
    assert hit.num_computed_tokens == 28 and pool.block_ids("b")[:5] == (NULL_BLOCK,) * 5
    assert pool.block_ids("b")[5:7] == pool.block_ids("a")[5:7]  # shared, the rest not taken
    check_invariants(pool, [a, b])
    pool.free(a)
    check_invariants(pool, [b])
    pool.free(b)
    check_invariants(pool, [])
    assert pool.ref_count(NULL_BLOCK) == 1 and pool.num_free_blocks == 11


def test_pool_without_a_window_is_unchanged():
    pool = BlockPool(4, BS)
    assert pool.num_usable_blocks == 4 and pool.num_skipped_blocks(1000) == 0
    assert pool.max_blocks_for(100, max_chunk_tokens=1) == 25
