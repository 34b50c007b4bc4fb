"""Receiving a distributed weight update into a shadow copy of the weights.

The group itself (forming it, the broadcasts, closing it) is the recipe
both ends share, `trillium/distributed/update_group.py`; this module is the
engine's side of what arrives: `ShadowWeights` gives one receive buffer per
named tensor (update order), and its `ShadowPlan` says what to swap in or
copy once every tensor arrived and was validated.
"""

from __future__ import annotations

import attrs
import torch

from trillium.kernels import onednn_packed


class ShadowWeights:
    """A second copy of the model's parameters that updates are received into.

    WHY: receiving into fresh buffers and then copying into the model cost a
    page fault per 4 KiB (about 0.2 s for SmolLM2's 538 MB on CPU) plus the
    copy (0.035 s) on top of the transfer itself. The shadow is allocated at
    the first update and reused; a parameter the update covers entirely is
    then swapped in (`param.data`, old storage becomes the shadow's), with no
    copy at all; on the CPU it is copied in instead (the 0.035 s, no page
    faults: both sides are resident), so the live weights stay in the
    huge-page arena the loader put them in (models/weight_arena.py).
    Nothing in the live model is touched until every tensor has arrived and
    the update was validated, so a transfer that fails half way leaves the
    old weights serving.

    Tensors that cannot land in the shadow (another dtype than the model's,
    a name the model ignores or lacks, a wrong shape, a parameter asleep
    without storage) get a buffer of their own and go through the checked
    copy path (`weights.apply`), which also turns bad names into 400s.
    """

    def __init__(self, model) -> None:
        self._model = model
        self._shadow: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._shadow.values())

    def buffers(
        self,
        names: tuple[str, ...],
        dtypes: tuple[torch.dtype, ...],
        shapes: tuple[tuple[int, ...], ...],
        device: torch.device,
    ) -> tuple[list[torch.Tensor], "ShadowPlan"]:
        """One receive buffer per named tensor, and what to do with them once filled."""
        params = dict(self._model.named_parameters())
        plan = ShadowPlan()
        buffers = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            shape = tuple(shape)
            target = self._model.resolve_weight(name)
            buffer = None
            # NOTE: a tensor that tensor parallelism splits is never received in place: each rank keeps
            # its slice through load_weights (a row-parallel bias has its full shape, and only rank 0 keeps it).
            if self._model.tp.splits(name):
                target = None
            if target is not None and target[0] in params and params[target[0]].numel() > 0:
                param_name, rows = target
                param = params[param_name]
                expected = tuple(param.shape) if rows is None else (rows[1], *param.shape[1:])
                if dtype == param.dtype and shape == expected and param.device == device:
                    shadow = self._shadow.get(param_name)
                    if shadow is None or shadow.shape != param.shape:
                        shadow = self._shadow[param_name] = torch.empty_like(param)
                    buffer = shadow if rows is None else shadow.narrow(0, rows[0], rows[1])
                    plan.cover(param_name, param.shape[0], rows)
            if buffer is None:
                buffer = torch.empty(shape, dtype=dtype, device=device)
                plan.separate.append(len(buffers))
            buffers.append(buffer)
        return buffers, plan

    def swap_in(self, plan: "ShadowPlan") -> None:
        """Make the received (and validated) shadow rows live."""
        params = dict(self._model.named_parameters())
        onednn_packed.forget()  # INVARIANT (kernels/onednn_packed.py): these writes bump no version counter
        for param_name, rows in plan.covered.items():
            param, shadow = params[param_name], self._shadow[param_name]
            if rows is None and param.device.type != "cpu":
                param.data, self._shadow[param_name] = shadow, param.data
            elif rows is None:  # on the CPU the weights stay in their arena (models/weight_arena.py)
                param.data.copy_(shadow)
            else:
                for start, length in rows:
                    param.data.narrow(0, start, length).copy_(shadow.narrow(0, start, length))

    def release(self) -> None:
        self._shadow = {}


@attrs.define
class ShadowPlan:
    """covered: parameter -> None (every row arrived: swap) or the row slices to copy.
    separate: indices of tensors received outside the shadow (copied by weights.apply)."""

    covered: dict[str, list[tuple[int, int]] | None] = attrs.field(factory=dict)
    separate: list[int] = attrs.field(factory=list)
    _rows: dict[str, tuple[int, list[tuple[int, int]]]] = attrs.field(factory=dict)

    def cover(self, param_name: str, num_rows: int, rows: tuple[int, int] | None) -> None:
        if rows is None:
            self.covered[param_name] = None
            return
        _, slices = self._rows.setdefault(param_name, (num_rows, []))
        if rows not in slices:
            slices.append(rows)
        full = sum(length for _, length in slices) == num_rows and _disjoint(slices)
        self.covered[param_name] = None if full else list(slices)


def _disjoint(slices: list[tuple[int, int]]) -> bool:
    ordered = sorted(slices)
    return all(a[0] + a[1] <= b[0] for a, b in zip(ordered, ordered[1:]))
