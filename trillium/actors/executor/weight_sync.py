"""Weights update group: a torch.distributed group between a trainer and the engine.

SGLang's semantics: the trainer is rank 0 and broadcasts each named tensor;
the engine's executor joins at `rank_offset` (ranks in between belong to
other engine replicas or TP ranks) and receives them in the order the
update command names them.

The group is built directly, without `torch.distributed.init_process_group`
(which a process may call once, and which a trainer has usually spent on its
own training group):

    store = rendezvous("tcp://<master_address>:<master_port>", rank, world_size)
            (rank 0 hosts the TCPStore; the others connect to it)
    group = ProcessGroupGloo | ProcessGroupNCCL (PrefixStore("<group_name>/", store), rank, world_size)

`open_group` is the recipe for both sides: a trainer calls it with rank=0
(`trillium.rlhf` does), the engine with rank=rank_offset. Every blocking step
is bounded by `timeout_s`: a peer that never joins or never sends gives a
`TimeoutError`, never a hang.
"""

from __future__ import annotations

import datetime

import attrs
import torch

NamedTensors = list[tuple[str, torch.Tensor]]


def open_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_s: float = 60.0,
):
    """Join (rank 0: host) the group; TimeoutError if the others do not come."""
    from torch.distributed import PrefixStore, rendezvous

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    try:
        store, _, _ = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
        store = PrefixStore(f"{group_name}/", store)
        if backend == "gloo":
            return torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(store, rank, world_size, options)
    except (RuntimeError, OSError) as exc:
        if _is_timeout(exc):
            raise TimeoutError(
                f"weights update group {group_name!r}: rank 0 ({master_address}:{master_port}) "
                f"did not join within {timeout_s:g} s"
            ) from exc
        raise


def broadcast(group, tensor: torch.Tensor, src: int = 0) -> None:
    """One broadcast from `src`; TimeoutError when it does not finish in time."""
    _wait(group.broadcast(tensor, src), src)


def _wait(work, src: int = 0) -> None:
    try:
        work.wait()
    except RuntimeError as exc:
        if _is_timeout(exc):
            raise TimeoutError(f"broadcast from rank {src} timed out: {exc}") from exc
        raise


class ShadowWeights:
    """A second copy of the model's parameters that updates are received into.

    WHY: receiving into fresh buffers and then copying into the model cost a
    page fault per 4 KiB (about 0.2 s for SmolLM2's 538 MB on CPU) plus the
    copy (0.035 s) on top of the transfer itself. The shadow is allocated at
    the first update and reused; a parameter the update covers entirely is
    then swapped in (`param.data`, old storage becomes the shadow's), with no
    copy at all. Nothing in the live model is touched until every tensor has
    arrived and the update was validated, so a transfer that fails half way
    leaves the old weights serving.

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
        for param_name, rows in plan.covered.items():
            param, shadow = params[param_name], self._shadow[param_name]
            if rows is None:
                param.data, self._shadow[param_name] = shadow, param.data
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


def receive_tensors(group, buffers: list[torch.Tensor]) -> None:
    """Fill `buffers`, in order, from rank 0's broadcasts."""
    works = [group.broadcast(buffer, 0) for buffer in buffers]  # queued: gloo runs them back to back
    for work in works:
        _wait(work)


def close_group(group) -> None:
    """Shut the group down. NOTE: the caller must also drop its last reference
    before the interpreter exits: a gloo group destroyed during interpreter
    shutdown aborts the process ("terminate called without an active exception")."""
    shutdown = getattr(group, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except RuntimeError:
            pass  # already broken (a peer left): dropping it is all there is to do


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text or type(exc).__name__ == "DistNetworkError"
