"""cache_salt separates prefix-cache entries (pure BlockPool tests).

vLLM mixes a request's `cache_salt` into the extra keys of its first block
only (vllm/v1/core/kv_cache_utils.py, `generate_block_hash_extra_keys`:
`if start_token_idx == 0 and request.cache_salt`); every later block chains
from the first, so the whole chain differs. Trillium does the same with the
salt as the first block's parent (block_pool.salt_root).
"""

from __future__ import annotations

from support.pool_requests import FakeRequest, admit
from trillium.actors.kv_tiers.block_pool import NO_HIT, BlockPool, salt_root


def test_salt_changes_every_block_hash_of_the_chain():
    pool = BlockPool(16, 4)
    plain, salted = FakeRequest("a", range(12)), FakeRequest("b", range(12), cache_salt="s")
    pool.update_block_hashes(plain)
    pool.update_block_hashes(salted)
    assert len(plain.block_hashes) == len(salted.block_hashes) == 3
    assert not set(plain.block_hashes) & set(salted.block_hashes)
    assert salt_root(None) is None and salt_root("s") not in salted.block_hashes


def test_only_the_same_salt_hits():
    pool = BlockPool(32, 4)
    admit(pool, FakeRequest("a", range(9), cache_salt="alice"))
    assert admit(pool, FakeRequest("b", range(9)), compute=False) == NO_HIT
    assert admit(pool, FakeRequest("c", range(9), cache_salt="bob"), compute=False) == NO_HIT
    again = FakeRequest("d", range(9), cache_salt="alice")
    assert admit(pool, again, compute=False).num_computed_tokens == 8


def test_an_unsalted_prefix_is_not_found_by_a_salted_request():
    pool = BlockPool(32, 4)
    admit(pool, FakeRequest("a", range(9)))
    assert admit(pool, FakeRequest("b", range(9), cache_salt="x"), compute=False) == NO_HIT
    assert admit(pool, FakeRequest("c", range(9)), compute=False).num_computed_tokens == 8
