"""Weight updates and the proposer: the flush on every update, and updating the draft itself.

    flush_draft_state(core) -> dict     after every weight update, target's or draft's
                                        (executor/control.py `_swap`, `_draft_swap`)
    DraftWeights(core)                  the draft's side of /update_weights_from_disk and
                                        /update_weights_from_tensor with draft_model_only
        .read_checkpoint(path) -> NamedTensors
        .check(named, complete) -> set[str]      400 (ControlError) before anything is copied
        .apply(named)

What goes stale when weights change. Output never does: every draft is
verified against the target (verify.py), so a stale draft costs acceptance,
never correctness. But per-request proposer state would carry the old
weights into the new version:
  - eagle: a request's head KV (`RequestState.eagle_kv`) was computed from
    the target's hidden states and by the head: stale after either update;
  - draft_model: a request's draft KV (`DraftModelProposer.seqs`) was
    computed by the draft's weights: stale after a draft update; after a
    target update it is still the draft's own, but it is dropped too, so the
    rule is one line: no proposer state survives a weight-version change;
  - every method: a request's adaptive depth (`RequestState.depth`, the
    acceptance EMA) measured the old pair of weights: it starts afresh.
All of it is rebuilt from the request's tokens on its next step (the draft
re-prefills, the head refills from the target's rows): less context for one
step, exact as ever. The reply's `draft` entry says what was dropped.

The draft's own update follows SGLang's shape (the scheduler's
update_weights_from_tensor hands the tensors to the draft worker,
python/sglang/srt/managers/scheduler_update_weights_mixin.py; the
`disable_draft_model` field of UpdateWeightsFromTensorReqInput in
python/sglang/srt/managers/io_struct.py skips it) with the routing flag the
SGLang-based RL stacks send to update the draft alone (`draft_model_only`).
Unlike SGLang's MTP/EAGLE drafts, which live in the target's checkpoint
namespace, Trillium's draft is its own checkpoint, so an update is either the
target's or the draft's, never both. The checks are the target's: a
draft model is a Trillium model, so executor/weights.py's WeightValidator
(load_weights on a meta twin) checks it; an EAGLE head is checked against
its own HF names and shapes (`EagleHead.hf_weights`). A failure leaves the
old draft weights serving.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from trillium.actors.executor import weights
from trillium.actors.protocol.admin import ControlError
from trillium.kernels import onednn_packed
from trillium.speculative.proposer import AdaptiveDepth


def flush_draft_state(core) -> dict:
    """Drop every request's proposer state (see the module docstring); what was dropped."""
    method = core.config.speculative_config.method
    num_states = 0
    for state in core.requests.values():
        if state.eagle_kv is None and state.depth is None:
            continue
        num_states += 1
        state.eagle_kv = None
        if state.depth is not None:  # WHY a fresh one, not None: drafts already proposed are verified next
            state.depth = AdaptiveDepth(state.depth.k)
    num_draft_caches = 0
    if hasattr(core.proposer, "weights_changed"):  # what the proposer derived from its weights (draft_model.py)
        core.proposer.weights_changed()
    seqs = getattr(core.proposer, "seqs", None)
    if seqs:  # the draft model's per-request caches
        num_draft_caches = len(seqs)
        core.proposer.release(list(seqs))
    return {"method": method or None, "flushed": bool(method),
            "num_requests_flushed": num_states, "num_draft_caches_flushed": num_draft_caches}


class DraftWeights:
    """Validate and copy weights into the configured proposer's model (draft model or EAGLE head)."""

    def __init__(self, core) -> None:
        method = core.config.speculative_config.method
        if method == "draft_model":
            self._impl = _DraftModelWeights(core.proposer.model)
        elif method == "eagle":
            self._impl = _HeadWeights(core.proposer.head, core.model.config)
        else:
            what = f"method {method!r}" if method else "no --speculative-config"
            raise ControlError(400, f"draft_model_only: this server has no draft weights to update ({what}; "
                                    "only the draft_model and eagle methods have a model)", {"param": "draft_model_only"})
        self.method = method

    def read_checkpoint(self, path: str) -> weights.NamedTensors:
        return self._impl.read_checkpoint(path)

    def check(self, named: weights.NamedTensors, *, complete: bool = False) -> set[str]:
        return self._impl.check(named, complete)

    def apply(self, named: weights.NamedTensors) -> None:
        self._impl.apply(named)


class _DraftModelWeights:
    """A draft model: a Trillium model, checked and loaded exactly as the target is."""

    def __init__(self, model) -> None:
        self.model = model
        self.validator = weights.WeightValidator(model)

    def read_checkpoint(self, path: str) -> weights.NamedTensors:
        return weights.read_checkpoint(path, self.model)  # the structure is the running draft's

    def check(self, named, complete: bool) -> set[str]:
        return self.validator.check(named, complete=complete)

    def apply(self, named) -> None:
        weights.apply(self.model, named)


class _HeadWeights:
    """An EAGLE head: tensors by the checkpoint's HF names (eagle_checkpoint.py), shapes as loaded."""

    def __init__(self, head, target_config) -> None:
        self.head = head
        self.target_config = target_config
        self.shapes = {name: tuple(t.shape) for name, t in head.hf_weights().items()}

    def read_checkpoint(self, path: str) -> weights.NamedTensors:
        from trillium.speculative import eagle_checkpoint

        try:
            config = eagle_checkpoint.read_config(path)
            eagle_checkpoint.check_against_target(config, self.target_config, path)
            return list(eagle_checkpoint.read_weights(path, config).items())
        except (OSError, ValueError, KeyError) as exc:
            raise ControlError(400, f"cannot load EAGLE head {path!r}: {exc}") from None

    def check(self, named: Iterable[tuple[str, torch.Tensor]], complete: bool) -> set[str]:
        seen: set[str] = set()
        for name, tensor in named:
            bare = name.removeprefix("model.")
            if bare not in self.shapes:
                raise ControlError(400, f"unknown weight: {name!r} is not a tensor of the EAGLE head "
                                        f"(it has {sorted(self.shapes)[:4]}...)")
            if not tensor.dtype.is_floating_point:
                raise ControlError(400, f"{name}: dtype {tensor.dtype} is not a floating dtype")
            if tuple(tensor.shape) != self.shapes[bare]:
                raise ControlError(400, f"bad weight: {name} has shape {tuple(tensor.shape)}, "
                                        f"the EAGLE head's is {self.shapes[bare]}")
            seen.add(bare)
        if complete:
            missing = sorted(set(self.shapes) - seen)
            if missing:
                raise ControlError(400, f"checkpoint lacks {len(missing)} weights of the EAGLE head, e.g. {missing[:4]}")
        return seen

    def apply(self, named) -> None:
        # WHY merge with the live tensors: load_hf takes the whole head (q/k/v fuse into one
        # parameter); an update may carry only some names.
        merged = self.head.hf_weights()
        merged.update({name.removeprefix("model."): t for name, t in named})
        self.head.load_hf(merged)
        onednn_packed.forget()  # INVARIANT (kernels/onednn_packed.py): no packed copy outlives a write
