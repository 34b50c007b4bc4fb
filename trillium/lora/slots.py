"""Device-resident LoRA slots: stacked A/B buffers for `max_loras` adapters.

    LoRASlots(model_config, max_loras, max_rank, dtype, device)
        .load(slot, adapter)   copy an adapter in (scaling folded into B, ranks zero-padded)
        .clear(slot)           zero a slot
        .targets(slot)         HF modules the slot's adapter adapts (empty when free)

Layout, per layer and per fused projection of the model (R = max_rank,
L = max_loras), allocated once, zeroed:

    qkv_proj      a [L, 3R, hidden]   b: q [L, q_size, R]  k [L, kv_size, R]  v [L, kv_size, R]
    o_proj        a [L, R, q_size]    b: o [L, hidden, R]
    gate_up_proj  a [L, 2R, hidden]   b: gate [L, inter, R]  up [L, inter, R]
    down_proj     a [L, R, inter]     b: down [L, hidden, R]

The A rows of a projection's slices are stacked (slice i at rows
[iR, iR + r)), so one shrink serves q, k and v (and gate, up) and each
slice's expand reads its R columns of the shrink output. A rank r < R
leaves rows/columns [r, R) zero, and a module the adapter does not target
stays all zero: both add exact zeros, so no per-slot rank or mask exists.

The slot table (which adapter lives where) belongs to the executor; this
object only holds the tensors. NOTE: not safe to `load` while a forward
pass reads the buffers.
"""

from __future__ import annotations

import attrs
import torch

from trillium.lora.adapter import AdapterError, LoRAAdapter, module_dims
from trillium.models.config import ModelConfig, torch_dtype

# Fused projection of our model -> the HF modules that are the slices of its
# output, in row order (see `llama._STACKED_PARAMS`).
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
MODULE_TO_PROJECTION = {m: (p, i) for p, modules in PROJECTIONS.items() for i, m in enumerate(modules)}


@attrs.frozen(eq=False)
class ProjectionBuffers:
    """Stacked LoRA weights of one fused projection in one layer."""

    modules: tuple[str, ...]  # HF modules, slices of the projection's output in order
    a: torch.Tensor  # [max_loras, len(modules) * max_rank, in_features]
    b: tuple[torch.Tensor, ...]  # per module [max_loras, out_features_i, max_rank]
    out_offsets: tuple[int, ...]  # first output column of each slice


class LoRASlots:
    """`max_loras` adapter slots of rank up to `max_rank`, in `dtype` on `device`."""

    def __init__(
        self,
        model_config: ModelConfig,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_rank}) must be >= 1")
        self.model_config = model_config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = torch_dtype(dtype or model_config.dtype)
        self.device = torch.device(device)
        dims = module_dims(model_config)
        self.layers: list[dict[str, ProjectionBuffers]] = [
            {name: self._allocate(modules, dims) for name, modules in PROJECTIONS.items()}
            for _ in range(model_config.num_layers)
        ]
        self._targets: list[frozenset[str]] = [frozenset()] * max_loras

    def _allocate(self, modules: tuple[str, ...], dims: dict[str, tuple[int, int]]) -> ProjectionBuffers:
        factory = {"dtype": self.dtype, "device": self.device}
        in_features = dims[modules[0]][0]
        a = torch.zeros(self.max_loras, len(modules) * self.max_rank, in_features, **factory)
        b = tuple(torch.zeros(self.max_loras, dims[m][1], self.max_rank, **factory) for m in modules)
        offsets = [0]
        for m in modules[:-1]:
            offsets.append(offsets[-1] + dims[m][1])
        return ProjectionBuffers(modules=modules, a=a, b=b, out_offsets=tuple(offsets))

    @property
    def num_bytes(self) -> int:
        """Device memory the buffers take."""
        return sum(
            buf.a.nbytes + sum(b.nbytes for b in buf.b) for layer in self.layers for buf in layer.values()
        )

    def targets(self, slot: int) -> frozenset[str]:
        """HF module names the adapter in `slot` adapts; empty for a free slot."""
        self._check_slot(slot)
        return self._targets[slot]

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise IndexError(f"LoRA slot {slot} out of range [0, {self.max_loras})")

    def _check_adapter(self, adapter: LoRAAdapter) -> None:
        if adapter.rank > self.max_rank:
            raise AdapterError(f"{adapter.path}: LoRA rank {adapter.rank} exceeds max_lora_rank {self.max_rank}")
        dims = module_dims(self.model_config)
        for (layer, module), w in adapter.weights.items():
            in_features, out_features = dims[module]
            expected_a, expected_b = (adapter.rank, in_features), (out_features, adapter.rank)
            if layer >= len(self.layers) or tuple(w.a.shape) != expected_a or tuple(w.b.shape) != expected_b:
                raise AdapterError(f"{adapter.path}: layer {layer} {module} does not fit this model")

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        """Zero every buffer of `slot` (its adapter then adds nothing)."""
        self._check_slot(slot)
        for layer in self.layers:
            for buf in layer.values():
                buf.a[slot].zero_()
                for b in buf.b:
                    b[slot].zero_()
        self._targets[slot] = frozenset()

    @torch.no_grad()
    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Replace `slot`'s contents with `adapter` (validated first, so a bad one leaves the slot as it was)."""
        self._check_slot(slot)
        self._check_adapter(adapter)
        self.clear(slot)
        rank, max_rank = adapter.rank, self.max_rank
        for (layer, module), w in adapter.weights.items():
            projection, index = MODULE_TO_PROJECTION[module]
            buf = self.layers[layer][projection]
            buf.a[slot, index * max_rank : index * max_rank + rank].copy_(w.a)
            # WHY float32: fold the scaling before rounding to the slot dtype, once.
            buf.b[index][slot, :, :rank].copy_(w.b.float() * adapter.scaling)
        self._targets[slot] = adapter.target_modules
