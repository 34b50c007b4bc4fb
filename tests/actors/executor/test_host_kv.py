"""The host KV tier's memory on the executor side: copies by block, any cache layout."""

from __future__ import annotations

import attrs
import numpy as np
import torch

from trillium.actors.executor.host_kv import HostKvStore
from trillium.actors.protocol.execute import KvTransfers


def _batch(saves=(), loads=()) -> KvTransfers:
    arr = lambda values: np.asarray(values, dtype=np.int32)  # noqa: E731
    return KvTransfers(
        save_block_ids=arr([b for b, _ in saves]), save_host_slots=arr([s for _, s in saves]),
        load_host_slots=arr([s for s, _ in loads]), load_block_ids=arr([b for _, b in loads]),
    )


def test_saves_run_before_loads_and_copy_whole_blocks():
    caches = [(torch.randn(6, 4, 2, 3), torch.randn(6, 4, 2, 3)) for _ in range(2)]
    original = [tuple(t.clone() for t in pair) for pair in caches]
    store = HostKvStore(caches, num_blocks=6, num_slots=3, block_size=4, device=torch.device("cpu"))
    assert store.block_bytes == 2 * 2 * 4 * 2 * 3 * 4
    # Block 1 is saved to slot 2 and slot 2 is loaded into block 1 in the same
    # step: saves go first, so block 1 gets its own content back.
    store.apply(caches, _batch(saves=[(1, 2), (4, 0)], loads=[(2, 1), (0, 5)]))
    for layer, before in zip(caches, original):
        for t, t0 in zip(layer, before):
            assert torch.equal(t[1], t0[1]) and torch.equal(t[5], t0[4])
            assert torch.equal(t[0], t0[0]) and torch.equal(t[4], t0[4])
    store.apply(caches, _batch())  # nothing to do


@attrs.define
class _QuantizedLayer:
    """A cache layout with per-block scales and a per-layer scalar (not per block)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    layer_scale: torch.Tensor


def test_any_per_block_tensor_is_copied_float8_included():
    fp8 = getattr(torch, "float8_e4m3fn", torch.uint8)

    def layer():
        return _QuantizedLayer(torch.randn(5, 4, 2).to(fp8), torch.randn(5, 4, 2).to(fp8), torch.rand(5, 2),
                               torch.tensor(0.5))

    caches = [layer(), layer()]
    store = HostKvStore(caches, num_blocks=5, num_slots=2, block_size=4, device=torch.device("cpu"))
    assert len(store.host) == 6  # k, v and k_scale of each layer; the scalar is not per block
    store.apply(caches, _batch(saves=[(3, 1)]))
    store.apply(caches, _batch(loads=[(1, 0)]))
    for cache in caches:
        assert torch.equal(cache.k.view(torch.uint8)[0], cache.k.view(torch.uint8)[3])
        assert torch.equal(cache.k_scale[0], cache.k_scale[3])
