"""Paged attention as one opaque op, so a compiled decode graph can call it.

    graph_kv_slots(context) -> one `GraphKvSlot` per layer: what a compiled
                               graph passes where eager code passes `KvCache`s
    GraphAttentionContext   the per-step state the op reads: the KV caches and
                            the step's `AttentionMetadata` (None while warming up)

WHY opaque: the attention of a paged batch depends on host-side metadata
that changes every step (sequence lengths, block tables, the CPU decode
plan in `kernels/reference.py`); traced, it would specialize on those and
recompile each step. So the compiled region stops at the attention (vLLM's
shape: `unified_attention` is a custom op that reads its metadata and cache
from the forward context, vllm/attention/layer.py): the op
`trillium::graph_attention(q, k, v, context, layer, ...)` looks the step up
in the context and runs the eager path, `KvCache.attend`. Inductor compiles
everything around it (the projections, norms, rope and SiLU are opaque ops too,
so a graph's row has eager's bits: kernels/dispatch.py).

Padding: a graph compiled for B rows may run a batch of n < B sequences;
rows n.. are padding. The op writes and attends rows 0..n-1 only and
returns zeros for the rest, so padding never touches the cache.

Warm-up (context.meta None): the op returns zeros and touches no cache,
so compiling at start never writes a block nor calibrates an fp8 scale.

Native (kernels/native_ops.py, when its C++ library loads): the slots call
`trillium_native::graph_attention` instead, which runs a step that
`native_ops.Step.set` took (float32 caches, a decode or verify step) in C++
-- the same slot writes and the same C kernel as `KvCache.attend` -- and
calls this op for any other step (fp8 caches, warm-up, ...).
"""

from __future__ import annotations

import itertools
import weakref

import attrs
import torch

from trillium.kernels import AttentionMetadata

# WHY a registry: a custom op's arguments are tensors and scalars, so the op
# finds its context by an integer id. Weak values: a dropped executor's
# context goes with it.
_CONTEXTS: weakref.WeakValueDictionary[int, "GraphAttentionContext"] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


@attrs.define(eq=False)
class GraphAttentionContext:
    """What the op reads at run time; set by the compiled runner before each call."""

    kv_caches: list = attrs.field(factory=list)
    meta: AttentionMetadata | None = None
    # kernels/native_ops.Step when the C++ ops are loaded: the graph's attention op reads it and
    # runs float32 decode / verify steps in C++ (the runner sets it per call; else this op runs).
    native_step: object | None = None
    context_id: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.context_id = next(_IDS)
        _CONTEXTS[self.context_id] = self


# NOTE: torch.library.Library, not @custom_op (see models/llama.py `cpu_linear`: per-call cost).
_LIB = torch.library.Library("trillium", "FRAGMENT")
_LIB.define("graph_attention(Tensor q, Tensor k, Tensor v, int context, int layer, float scale, "
            "int? sliding_window, float? softcap) -> Tensor")


def graph_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, layer: int, scale: float,
    sliding_window: int | None, softcap: float | None,
) -> torch.Tensor:  # fmt: skip
    """Write rows 0..n-1's keys/values into layer `layer`'s cache and attend; zeros for padded rows."""
    ctx = _CONTEXTS[context]
    if ctx.meta is None:
        return torch.zeros_like(q)
    num_tokens = ctx.meta.num_tokens
    cache = ctx.kv_caches[layer]
    if num_tokens == q.shape[0]:
        return cache.attend(q, k, v, ctx.meta, scale, sliding_window=sliding_window, softcap=softcap)
    out = torch.zeros_like(q)
    out[:num_tokens] = cache.attend(q[:num_tokens], k[:num_tokens], v[:num_tokens], ctx.meta, scale,
                                    sliding_window=sliding_window, softcap=softcap)  # fmt: skip
    return out


_LIB.impl("graph_attention", graph_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("trillium::graph_attention")
def _(q, k, v, context, layer, scale, sliding_window, softcap):
    return torch.empty_like(q)


@attrs.frozen
class GraphKvSlot:
    """Stands in for layer `layer`'s `KvCache` inside a compiled graph (same `attend` signature)."""

    context_id: int
    layer: int
    native_step: int = 0  # native_ops.Step.id, 0 for none

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float, *,
        sliding_window: int | None, softcap: float | None,
    ) -> torch.Tensor:  # fmt: skip
        if self.native_step:
            return torch.ops.trillium_native.graph_attention(
                q.contiguous(), k.contiguous(), v.contiguous(), self.context_id, self.native_step, self.layer, scale,
                sliding_window, softcap,
            )
        return torch.ops.trillium.graph_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), self.context_id, self.layer, scale, sliding_window,
            softcap,
        )


def graph_kv_slots(context: GraphAttentionContext, num_layers: int) -> list[GraphKvSlot]:
    step_id = context.native_step.id if context.native_step is not None else 0
    return [GraphKvSlot(context.context_id, i, step_id) for i in range(num_layers)]
