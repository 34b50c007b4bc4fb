"""oneDNN's float32 matmul on a weight packed once into its own blocked layout.

    linear(x [..., K] float32, weight [N, K] float32, bias [N] | None) -> [..., N] float32
    copy_of(weight, kind, make) -> Tensor   a parameter's copy `make(weight)`, made once per kind (the
                                            same cache and INVARIANT: panel_cpu.py keeps its panels here)
    forget() -> None        drop every packed copy, of every kind (called wherever weights change or go)
    packed_bytes() -> int   bytes the packed copies hold now
    ENABLED                 TRILLIUM_ONEDNN_PACKED (1, the default, or 0), read once at import

`models/llama.py` sends a float32 CPU linear of more rows than dense_cpu.MAX_ROWS (prefill
chunks, decode batches past dense_cpu's reach) to oneDNN's `mkldnn._linear_pointwise` (except where
kernels/panel_cpu.py takes them: a Zen 4-class CPU, its own copy in this cache). Given the
plain [N, K] weight, oneDNN reorders the whole weight into its blocked layout on every call, then
multiplies. Here the reorder runs once per weight (`mkldnn._reorder_linear_weight`, the layout
for a 64-row batch) and later calls take the packed copy, as vLLM's CPU backend does (its
`create_onednn_mm` handle). WHY: on the 2-core AMD EPYC (Zen 4) we benchmark on, the bench model's
33 linears at 2 threads (110 MB of weights, read from memory as in a decode step) took 23.1 / 29.0
ms at 64 rows packed / plain, 10.9 / 15.1 at 32, 75.5 / 78.2 at 256, 574 / 596 at 2048 rows
(bench/dense_linear.py prints both); 64 mixed requests at once, served, 1.14x output tok/s.
Only parameters are packed: a weight made for one call (a GGUF or int4 layer's dequantized matrix)
would be packed for nothing and its copy kept; those run on the plain tensor.
Results are oneDNN's on either layout (same blocked kernels; not bit for bit the plain call's at
every row count: a different kernel may be picked).

INVARIANT: a packed copy is used only for the weight it was made from, unchanged. Weights change by
writes that torch's version counter does not see (`param.data.copy_`, the loader's and the updaters'
way), so every place that changes or drops weights calls `forget()`: `LlamaForCausalLM.load_weights`
(start-up, updates from disk or a process group, the draft model's), the EAGLE head's update
(speculative/draft_weights.py), the shadow swap (executor/shadow_weights.py), the arena move
(models/weight_arena.py) and sleep level 2's discard (executor/memory.py). As a second guard a copy
is also made again when its weight's data pointer, shape or version counter moved, and it goes
when its parameter is freed.

Memory: the packed copies are a second copy of every float32 linear parameter that runs more than
dense_cpu.MAX_ROWS rows (made at its first such call, oneDNN's or the panel kernel's, whichever runs
those rows; sleep level 2 drops them). TRILLIUM_ONEDNN_PACKED=0 keeps oneDNN on the plain weights
(no oneDNN copy; the reorder on every call; the panel kernel's copies are TRILLIUM_PANEL_LINEAR's);
any other value than 0 or 1 is a start-up error.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

import torch

_BATCH_HINT = 64  # the row count oneDNN picks its packed layout for; as fast as each row count's own
# layout at 16-2048 rows on the bench shapes (a 1-row layout was 1.05-1.5x slower past 16 rows)


def _enabled() -> bool:
    asked = os.environ.get("TRILLIUM_ONEDNN_PACKED", "1")
    if asked not in ("0", "1"):
        raise ValueError(f"TRILLIUM_ONEDNN_PACKED={asked!r}: expected 1 (pack float32 weights for oneDNN once, "
                         "the default) or 0 (oneDNN reorders the plain weight on every call)")
    return asked == "1" and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


ENABLED = _enabled()
_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


class _Packed:
    """A weight's packed copy and what the weight was when it was made."""

    __slots__ = ("owner", "key", "tensor", "nbytes")

    def __init__(self, weight: torch.Tensor, kind: str, make: Callable[[torch.Tensor], torch.Tensor]):
        slot = (id(weight), kind)
        # the entry goes with its parameter (unless a newer entry took the slot meanwhile)
        self.owner = weakref.ref(weight, lambda ref: _COPIES.pop(slot) if _COPIES.get(slot, None) is not None
                                 and _COPIES[slot].owner is ref else None)
        self.key = _key(weight)
        self.tensor = make(weight.detach())
        self.nbytes = self.tensor.numel() * self.tensor.element_size() if self.tensor.layout == torch.strided \
            else weight.numel() * weight.element_size()  # oneDNN's opaque tensor: about the weight's size


def _key(weight: torch.Tensor) -> tuple:
    # NOTE: an inference tensor (made under torch.inference_mode) has no version counter
    version = -1 if weight.is_inference() else weight._version
    return weight.data_ptr(), tuple(weight.shape), weight.stride(), version


# (id(weight), kind) -> its packed copy. WHY id and a weak reference rather than a WeakKeyDictionary:
# tensors compare elementwise, and the weak reference tells a reused id from the same weight.
_COPIES: dict[tuple[int, str], _Packed] = {}


def copy_of(weight: torch.Tensor, kind: str, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`make(weight)` for this parameter, made at the first call per `kind` and again only after
    forget() or when the weight moved, changed shape or version (the INVARIANT above)."""
    entry = _COPIES.get((id(weight), kind))
    if entry is None or entry.owner() is not weight or entry.key != _key(weight):
        entry = _COPIES[(id(weight), kind)] = _Packed(weight, kind, make)
    return entry.tensor


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's x @ weight.T + bias, on the packed copy (ENABLED) or on the plain weight."""
    if ENABLED and isinstance(weight, torch.nn.Parameter) and weight.dim() == 2 and weight.is_contiguous():
        return _LINEAR(x, copy_of(weight, "onednn", _reorder), bias, "none", [], "")
    return _LINEAR(x, weight, bias, "none", [], "")


def forget() -> None:
    """Drop every packed copy: the next call of each weight packs it afresh (see the INVARIANT)."""
    _COPIES.clear()


def packed_bytes() -> int:
    return sum(entry.nbytes for entry in _COPIES.values())


available = _LINEAR is not None

__all__ = ["ENABLED", "available", "copy_of", "forget", "linear", "packed_bytes"]
