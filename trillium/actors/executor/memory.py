"""Sleep and wake of the executor's memory: KV cache tensors and weights.

    level 1  KV cache freed; on CUDA the weights move to host memory
             (on CPU they stay: host memory is where they already are)
    level 2  KV cache and weights freed. The module tree stays; each
             parameter keeps its dtype and device but holds no storage.
             A weight update while asleep refills them (in host memory);
             until every weight has been refilled, waking "weights" is a 409.
             On the CPU the refilled parameters go into one arena again
             (models/weight_arena.py).

Waking is per tag ("weights", "kv_cache"), in either order. The KV cache
comes back zeroed (its content is gone; the scheduler reset its prefix
cache at sleep), an fp8 cache with its scales uncalibrated (the first write
sets them again, models/kv_cache.py), and the weights go back to the device.

Keeping the prefix cache (--sleep-keep-prefix-cache, level 1): the Sleep
carries the scheduler's copies of the cached device blocks into the host KV
tier (applied through executor/kv_stores.py), first, before the cache is freed. The host
blocks were quantized with the fp8 scales of the time, so those are kept
too: the wake gives each layer of the new cache its old scales, calibrated,
instead of calibrating afresh. A weight update that flushes the cache while
asleep drops the kept scales (the scheduler dropped the host blocks).

Freed means freed: the last references are dropped (the per-thread gather
workspace of the reference kernels too), then `gc.collect()`, and on CPU
glibc's `malloc_trim(0)` hands free heap pages back to the OS, on CUDA
`torch.cuda.empty_cache()` hands them back to the driver. Runs on the
executor's torch thread, between steps.
"""

from __future__ import annotations

import gc
import logging
import os

import torch

from trillium.actors.protocol.execute import NO_TRANSFERS, KvTransfers
from trillium.actors.protocol.admin import ControlError
from trillium.actors.protocol.vocabulary import WakeTag
from trillium.kernels import onednn_packed
from trillium.models import weight_arena

log = logging.getLogger(__name__)


def resident_bytes() -> int:
    """This process's resident set size (/proc/self/statm)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _kept_scales(cache) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A layer's calibrated fp8 scales, copied to host memory; None if it has none yet."""
    if getattr(cache, "k_scale", None) is None or not cache.calibrated:
        return None
    return cache.k_scale.to("cpu", copy=True), cache.v_scale.to("cpu", copy=True)


class DeviceMemory:
    """What of the executor's memory is asleep; does the freeing and refilling."""

    def __init__(self, core) -> None:
        self.core = core  # ExecutorCore: owns .model, .kv_caches, .config
        self.asleep: set[WakeTag] = set()
        self.level = 0
        # Level 2: parameter name -> (shape, dtype) to rebuild storage from,
        # and the checkpoint names not loaded since the discard.
        self._shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._missing: set[str] = set()
        # Kept prefix cache: per layer, the fp8 (k_scale, v_scale) to restore at the wake
        # (None for a float or an uncalibrated layer).
        self._kv_scales: list[tuple[torch.Tensor, torch.Tensor] | None] = []

    @property
    def host(self) -> torch.device:
        return torch.device("cpu")

    @property
    def device(self) -> torch.device:
        return self.core.device

    @property
    def num_missing_weights(self) -> int:
        return len(self._missing)

    def sleep(self, level: int, *, keep_prefix_cache: bool = False, kv: KvTransfers = NO_TRANSFERS) -> dict:
        """Free the KV cache and the weights (see the module docstring). With
        `keep_prefix_cache` first apply `kv` (the disk tier's queued
        operations, then the spilled device blocks' saves into host slots:
        kv_stores.py) and keep the fp8 scales for the wake."""
        if self.asleep:
            raise ControlError(409, f"already asleep (level {self.level})")
        num_saved = 0
        if keep_prefix_cache and not kv.empty:
            self.core.kv_stores.apply(self.core.kv_caches, kv)
            num_saved = len(kv.save_block_ids)
        self._kv_scales = [_kept_scales(cache) for cache in self.core.kv_caches] if keep_prefix_cache else []
        rss_before = resident_bytes()
        device_before = self._device_allocated()
        kv_bytes = sum(_tensor_bytes(t) for pair in self.core.kv_caches for t in pair)
        self.core.kv_caches = []
        # A draft model's cache and weights (speculative/draft_model.py).
        draft = getattr(getattr(self.core, "proposer", None), "sleep", None)
        kv_bytes += draft() if draft is not None else 0
        weight_bytes = 0
        if level == 2:
            weight_bytes = self._discard_weights()
        elif self.device.type != "cpu":
            self.core.model.to(self.host)
        self._release()
        self.asleep = set(WakeTag)
        self.level = level
        log.info("executor asleep (level %d): freed %d KV bytes, %d weight bytes", level, kv_bytes, weight_bytes)
        return {
            "level": level,
            "asleep": sorted(self.asleep),
            "freed_kv_cache_bytes": kv_bytes,
            "freed_weight_bytes": weight_bytes,
            "kept_prefix_cache": keep_prefix_cache,
            "num_saved_kv_blocks": num_saved,
            "rss_freed_bytes": rss_before - resident_bytes(),
            "device_freed_bytes": device_before - self._device_allocated(),
        }

    def wake_up(self, tags: tuple[WakeTag, ...]) -> dict:
        if WakeTag.WEIGHTS in tags and WakeTag.WEIGHTS in self.asleep:
            if self._missing:
                raise ControlError(
                    409,
                    f"the weights were discarded by sleep level 2 and {len(self._missing)} of them "
                    "have not been reloaded: update the weights (from disk, tensors or distributed) "
                    "before waking them",
                )
            if self.device.type != "cpu":
                self.core.model.to(self.device)
            if hasattr(getattr(self.core, "proposer", None), "wake_weights"):
                self.core.proposer.wake_weights()
            self.asleep.discard(WakeTag.WEIGHTS)
        if WakeTag.KV_CACHE in tags and WakeTag.KV_CACHE in self.asleep:
            from trillium.models.llama import allocate_kv_caches

            cfg = self.core.config
            self.core.kv_caches = allocate_kv_caches(
                self.core.model.local_config, cfg.num_blocks, cfg.block_size, self.core.kv_cache_dtype, self.device
            )
            self._restore_kv_scales()
            if hasattr(getattr(self.core, "proposer", None), "wake_kv_cache"):
                self.core.proposer.wake_kv_cache(cfg)
            self.asleep.discard(WakeTag.KV_CACHE)
        if not self.asleep:
            self.level = 0
        return {"asleep": sorted(self.asleep), "rss_bytes": resident_bytes()}

    # -- weight updates while asleep ------------------------------------

    def before_weight_load(self) -> None:
        """Give discarded parameters storage again (host memory), so a weight
        update can fill them; called after the update was validated."""
        if not self._shapes:
            return
        params = dict(self.core.model.named_parameters())
        for name, (shape, dtype) in self._shapes.items():
            param = params[name]
            if param.numel() == 0 and shape.numel() > 0:
                param.data = torch.empty(shape, dtype=dtype, device=self.host)

    def weights_loaded(self, names: set[str]) -> None:
        self._missing -= names
        if not self._missing:
            if self._shapes and self.device.type == "cpu":  # refilled one by one: into an arena again
                weight_arena.pack(self.core.model, buffers=False)
            self._shapes = {}

    def forget_kv_scales(self) -> None:
        """The prefix cache was flushed (new weights): the wake calibrates afresh."""
        self._kv_scales = []

    # -- the kept prefix cache ---------------------------------------------

    def _restore_kv_scales(self) -> None:
        """Give the fresh cache the scales its host blocks were written with
        (models/kv_cache.py INVARIANT: a scale is fixed while blocks use it)."""
        kept, self._kv_scales = self._kv_scales, []
        for cache, scales in zip(self.core.kv_caches, kept):
            if scales is not None:
                cache.k_scale.copy_(scales[0])
                cache.v_scale.copy_(scales[1])
                cache.calibrated = True

    # -- internals ---------------------------------------------------------

    def _discard_weights(self) -> int:
        model = self.core.model
        freed = 0
        self._shapes = {}
        for name, param in model.named_parameters():
            self._shapes[name] = (param.shape, param.dtype)
            freed += _tensor_bytes(param)
            # WHY .data and not a new Parameter: the module tree and every
            # reference to the Parameter object stay valid.
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._missing = set(model.checkpoint_weight_names())
        onednn_packed.forget()  # the packed copies go with the weights they were made from
        return freed

    def _release(self) -> None:
        from trillium.kernels import reference

        # NOTE: the gather workspace is per thread; this runs on the torch
        # thread, whose workspace holds up to tens of MiB of K/V copies.
        reference._workspace.buffers.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        weight_arena.trim_host_heap()

    def _device_allocated(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return 0
