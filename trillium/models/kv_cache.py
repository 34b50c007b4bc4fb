"""The paged KV cache of a model: one `KvCache` per layer (keys, values, fp8 scales).

    KvCache                 k_cache, v_cache [num_blocks, block_size, KH, D];
                            unpacks as `k_cache, v_cache = kv_cache`;
                            k_scale / v_scale (fp8 caches only)
    KV_CACHE_DTYPES         the names --kv-cache-dtype takes once resolved
    kv_cache_torch_dtype    such a name (or a torch dtype) -> torch dtype
    kv_cache_block_bytes    bytes of one block across all layers
    allocate_kv_caches      one zeroed KvCache per layer

fp8 caches halve the bytes per token of bfloat16 (a quarter of float32's).
They store keys and values divided by a per-tensor scale, one float32 for
each layer's keys and one for its values, kept on the cache's device (the
kernels' semantics are in `trillium/kernels/fp8.py`).

The idea of the scales (dynamic, no calibration data): a fresh fp8 cache is
uncalibrated; the first write into a layer sets its scales from the keys and
values written (amax x headroom / the format's largest value, rounded up to
a power of two) and they stay fixed from then on. vLLM's default without
calibration is 1.0, which saturates models whose keys or values pass 448
(e4m3) and wastes range on small ones.

WHY a power of two: fp8 is floating point, so scaling by 2^n only moves the
range (no precision is lost or gained), x / scale is exact, and the scale
depends on amax's binade only. The first batch is whatever the scheduler ran
first (timing-dependent); an exact amax made the outputs of identical runs
differ with the batch, a binade rarely does.

INVARIANT: a scale never changes while blocks hold values quantized with it,
so it is set before the first value is written and never again for the life
of the tensors. Re-allocation (start, wake from sleep) starts uncalibrated,
except a wake that keeps the prefix cache (--sleep-keep-prefix-cache): its
blocks live on in the host KV tier, quantized with the old scales, so the
new tensors get those scales, calibrated (actors/executor/memory.py).
"""

from __future__ import annotations

import attrs
import torch

from trillium import kernels
from trillium.kernels.fp8 import fp8_max, is_fp8
from trillium.models.config import ModelConfig, torch_dtype
from trillium.models.weight_arena import huge_page_zeros

# Resolved --kv-cache-dtype names ("auto" resolves to the model dtype's name).
FP8_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPES = ("float32", "bfloat16", "float16", *FP8_KV_DTYPES)

# WHY headroom: the first batch need not hold a layer's largest keys/values;
# later ones above the scaled range saturate. fp8 is floating point, so the
# headroom costs precision only for values ~2^-15 (e4m3) below the largest.
# Measured on SmolLM2-135M (bench/kv_fp8_accuracy.py): headroom 1, 2 or 4
# and scale 1.0 agree within noise; its K/V amax is ~10-20 / ~1-12.
_SCALE_HEADROOM = 2.0
# WHY a floor: an all-zero (or tiny) first write must not make every later
# value saturate. Values below it are stored as if the amax were this.
_MIN_AMAX = 1.0


def kv_cache_torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """'fp8_e4m3' / 'fp8_e5m2' / 'float32' / 'bfloat16' / 'float16' (or a torch dtype) -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype if is_fp8(dtype) else torch_dtype(dtype)
    return FP8_KV_DTYPES.get(dtype) or torch_dtype(dtype)


@attrs.define(eq=False)
class KvCache:
    """One layer's cache. Float caches carry no scales (and cost no scale math)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None = None  # [] float32 on the cache's device (fp8 only)
    v_scale: torch.Tensor | None = None
    calibrated: bool = True  # fp8: False until the first write set the scales

    # WHY tuple-like: callers written for the (k_cache, v_cache) pair keep working.
    def __iter__(self):
        return iter((self.k_cache, self.v_cache))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index):
        return (self.k_cache, self.v_cache)[index]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_cache, self.v_cache))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float, *,
        sliding_window: int | None = None, softcap: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Write this step's keys/values (k, v [T, KH, D]) into the cache, then attend q [T, H, D] over it."""
        if not self.calibrated:  # fp8: the first write sets the scales
            self.calibrate(k, v)
        kernels.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        return kernels.paged_attention(q, self.k_cache, self.v_cache, meta, scale, self.k_scale, self.v_scale,
                                       sliding_window=sliding_window, softcap=softcap, k=k, v=v)  # fmt: skip

    def calibrate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Set the scales from the first keys/values written (call before writing them).

        No host sync: the scales are computed on the device. An empty write
        leaves the cache uncalibrated.
        """
        if self.calibrated or k.numel() == 0:
            return
        limit = fp8_max(self.k_cache.dtype)
        for x, scale in ((k, self.k_scale), (v, self.v_scale)):
            amax = x.detach().abs().amax().float().clamp(min=_MIN_AMAX)
            scale.copy_(torch.exp2(torch.ceil(torch.log2(amax * (_SCALE_HEADROOM / limit)))))
        self.calibrated = True


def kv_cache_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype | str) -> int:
    """Bytes one KV block takes across all layers (keys and values; the scales are noise)."""
    element_bytes = kv_cache_torch_dtype(dtype).itemsize
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element_bytes


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype | str,
    device: torch.device | str,
) -> list[KvCache]:
    """Per layer a KvCache of two zeroed [num_blocks, block_size, KH, D] tensors.

    fp8 caches start uncalibrated with scales 1.0 (see the module docstring).
    """
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    dtype = kv_cache_torch_dtype(dtype)
    on_cpu = torch.device(device).type == "cpu"
    caches = []
    for _ in range(config.num_layers):
        if on_cpu:  # on 2 MB pages, as the weights (weight_arena.huge_page_zeros says why)
            k_cache, v_cache = huge_page_zeros(shape, dtype), huge_page_zeros(shape, dtype)
        else:
            k_cache = torch.zeros(shape, dtype=dtype, device=device)
            v_cache = torch.zeros(shape, dtype=dtype, device=device)
        if is_fp8(dtype):
            ones = [torch.ones((), dtype=torch.float32, device=device) for _ in range(2)]
            caches.append(KvCache(k_cache, v_cache, *ones, calibrated=False))
        else:
            caches.append(KvCache(k_cache, v_cache))
    return caches
