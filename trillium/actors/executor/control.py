"""Executor side of the control plane: one handler per forwarded command.

Consumes (from the scheduler, always between two steps): Sleep, WakeUp,
UpdateWeightsFromDisk / FromTensors / FromDistributed,
InitWeightsUpdateGroup, DestroyWeightsUpdateGroup, StartProfile,
StopProfile. Produces one ControlReply each, same command_id:

    200  done; `data` says what (freed bytes, tags still asleep, files, ...)
    400  bad argument: unknown weight name, wrong shape or dtype, bad path
    409  not possible now: no update group, waking discarded weights, ...
    504  a trainer did not join / send within the group's timeout
    500  anything else (logged with its traceback)

With speculative decoding every weight update drops the proposer's
per-request state, and `draft_model_only` updates (disk, tensors) load the
draft model or EAGLE head instead of the target (speculative/draft_weights.py).

State owned: `DeviceMemory` (what is asleep), the weights update group
(and the join in progress), the torch profiler. Every blocking call (file
reads, copies, collectives) runs on the executor's torch thread, so the
trio loop stays free; the collectives carry the group's timeout, so none
of them can hold the executor forever.

One exception, InitWeightsUpdateGroup: the rendezvous waits for the
trainer, so it runs on a thread of its own (`group_join.py`) in a
background task, and `handle` returns None at once: steps go on while it
waits, and the reply is sent when the group is formed or the timeout
passes. Receiving over the group (UpdateWeightsFromDistributed) stays on
the torch thread, between two steps.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from functools import partial

import torch
import trio

from trillium.actors.executor import group_join, shadow_weights, weights
from trillium.actors.executor.memory import DeviceMemory
from trillium.actors.executor.profiling import TorchProfiler
from trillium.actors.protocol.admin import (
    ControlError,
    ControlReply,
    DestroyWeightsUpdateGroup,
    InitWeightsUpdateGroup,
    LoadLoRAAdapter,
    Sleep,
    StartProfile,
    StopProfile,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensors,
    UnloadLoRAAdapter,
    WakeUp,
)
from trillium.actors.protocol.vocabulary import WakeTag
from trillium.actors.torch_thread import TorchThread
from trillium.distributed import update_group
from trillium.speculative import draft_weights
from trillium.observability.profiling import LoopProfiler, NotProfiling

log = logging.getLogger(__name__)


class ExecutorControl:
    COMMANDS = (
        Sleep, WakeUp, UpdateWeightsFromDisk, UpdateWeightsFromTensors, UpdateWeightsFromDistributed,
        InitWeightsUpdateGroup, DestroyWeightsUpdateGroup, StartProfile, StopProfile,
        LoadLoRAAdapter, UnloadLoRAAdapter,
    )

    def __init__(self, core, torch_thread: TorchThread) -> None:
        self.core = core
        self.torch = torch_thread
        self.memory = DeviceMemory(core)
        # WHY the rank in the name under TP: every rank writes its own trace (tp_fanout.py).
        name = "executor" if core.tp.size == 1 else f"executor-rank{core.tp.rank}"
        self.profiler = TorchProfiler(core.device, name)
        self.timeline = LoopProfiler(name)  # StartProfile.timeline: spans only (core.stages)
        self._validator: weights.WeightValidator | None = None
        self._group = None
        self._group_name = ""
        self._group_backend = "gloo"
        self._joining: str | None = None  # the group being formed, off the torch thread
        self._nursery: trio.Nursery | None = None
        self._send: Callable[[ControlReply], Awaitable[None]] | None = None
        self._shadow: shadow_weights.ShadowWeights | None = None
        self._draft_weights: draft_weights.DraftWeights | None = None  # draft_model_only updates
        self._handlers = {
            Sleep: self._sleep, WakeUp: self._wake_up,
            UpdateWeightsFromDisk: self._from_disk, UpdateWeightsFromTensors: self._from_tensors,
            UpdateWeightsFromDistributed: self._from_distributed,
            DestroyWeightsUpdateGroup: self._destroy_group,
            StartProfile: self._start_profile, StopProfile: self._stop_profile,
            LoadLoRAAdapter: self._load_lora, UnloadLoRAAdapter: self._unload_lora,
        }

    @property
    def profile_deadline(self) -> float:
        return min(self.profiler.deadline, self.timeline.deadline)

    def start(self, nursery: trio.Nursery, send: Callable[[ControlReply], Awaitable[None]]) -> None:
        """Where background work (a join) runs, and how its reply reaches the scheduler."""
        self._nursery, self._send = nursery, send

    async def handle(self, message) -> ControlReply | None:
        """The command's reply; None when it comes later through `send` (a join)."""
        if isinstance(message, InitWeightsUpdateGroup):
            try:
                self._check_init(message)
            except ControlError as exc:
                return exc.reply(message.command_id)
            self._joining = message.group_name
            self._nursery.start_soon(self._join, message)
            return None
        return await self._answer(message, self._handlers[type(message)])

    async def _answer(self, message, handler) -> ControlReply:
        try:
            data = await handler(message)
        except ControlError as exc:
            return exc.reply(message.command_id)
        except TimeoutError as exc:
            return ControlReply(message.command_id, 504, str(exc))
        except Exception as exc:
            log.exception("executor: %s failed", type(message).__name__)
            return ControlReply(message.command_id, 500, f"{type(message).__name__} failed: {exc!r}")
        return ControlReply(message.command_id, 200, "ok", data)

    def close(self) -> None:
        """Drop the update group now: one left to interpreter shutdown aborts the process."""
        group, self._group = self._group, None
        self._release_shadow()
        if group is not None:
            update_group.close_group(group)

    def _release_shadow(self) -> None:
        if self._shadow is not None:
            self._shadow.release()
            self._shadow = None

    async def aclose(self) -> None:
        """Shutdown: release the group and a running profile, on the torch thread."""
        def release() -> None:
            self.close()
            self.profiler.discard()
            self.core.stages.profiler = None
            self.timeline.close()

        with trio.CancelScope(shield=True):
            await self.torch.run(release)

    async def expire_profile(self) -> None:
        if self.timeline.expire(trio.current_time()):
            self.core.stages.profiler = None
        if self.profiler.deadline <= trio.current_time():
            await self.torch.run(self.profiler.expire)

    # -- memory ---------------------------------------------------------

    async def _sleep(self, msg: Sleep) -> dict:
        def sleep() -> dict:
            self._release_shadow()
            return self.memory.sleep(msg.level, keep_prefix_cache=msg.keep_prefix_cache, kv=msg.kv)

        return await self.torch.run(sleep)

    async def _wake_up(self, msg: WakeUp) -> dict:
        return await self.torch.run(self.memory.wake_up, tuple(msg.tags))

    # -- weights ----------------------------------------------------------

    async def _from_disk(self, msg: UpdateWeightsFromDisk) -> dict:
        def load() -> dict:
            if msg.draft_model_only:
                draft = self._draft()
                return self._draft_swap(draft, draft.read_checkpoint(msg.model_path), complete=True)
            named = weights.read_checkpoint(msg.model_path, self.core.model)
            return self._swap(named, msg.flush_cache, complete=True)

        return await self.torch.run(load)

    async def _from_tensors(self, msg: UpdateWeightsFromTensors) -> dict:
        def read() -> weights.NamedTensors:
            if msg.safetensors_path is not None:
                return weights.read_safetensors_file(msg.safetensors_path)
            return weights.parse_safetensors(msg.safetensors)

        if msg.draft_model_only:
            return await self.torch.run(lambda: self._draft_swap(self._draft(), read()))
        return await self.torch.run(lambda: self._swap(read(), msg.flush_cache))

    async def _from_distributed(self, msg: UpdateWeightsFromDistributed) -> dict:
        if self._group is None:
            raise ControlError(409, "no weights update group is open")
        if not len(msg.names) == len(msg.dtypes) == len(msg.shapes):
            raise ControlError(
                400, f"names, dtypes and shapes differ in length ({len(msg.names)}, {len(msg.dtypes)}, {len(msg.shapes)})"
            )
        dtypes = tuple(weights.parse_dtype(d) for d in msg.dtypes)
        await self._check_announced(tuple(msg.names), dtypes, tuple(tuple(s) for s in msg.shapes))
        # WHY receive before the full validation: the trainer broadcasts every
        # tensor regardless; leaving the collective half way would strand it
        # until its timeout. What the announcement already shows to be wrong
        # (names, shapes, size) is refused above, before any buffer exists.
        device = self.core.device if self._group_backend == "nccl" else torch.device("cpu")

        if self._shadow is None:
            self._shadow = shadow_weights.ShadowWeights(self.core.model)
        shadow = self._shadow
        names = tuple(msg.names)

        def receive() -> tuple[weights.NamedTensors, shadow_weights.ShadowPlan]:
            buffers, plan = shadow.buffers(names, dtypes, tuple(msg.shapes), device)
            update_group.receive_tensors(self._group, buffers)
            return list(zip(names, buffers)), plan

        try:
            started_s = time.perf_counter()
            named, plan = await self.torch.run(receive)
            received_s = time.perf_counter()
        except Exception as exc:
            # WHY close: after a failed collective the two sides no longer
            # agree on which tensor comes next; a later update would read
            # misaligned data. The trainer must init a new group.
            await self.torch.run(self.close)
            status = 504 if isinstance(exc, TimeoutError) else 500
            raise ControlError(
                status, f"receiving weights failed ({exc}); the weights update group was closed: init it again",
                {"group_closed": True},
            ) from exc

        def swap() -> dict:
            return self._swap(named, msg.flush_cache, shadow=(shadow, plan))

        data = await self.torch.run(swap)
        log.info("received %d tensors (%.0f MB) from the update group in %.3f s, loaded in %.3f s",
                 len(named), sum(t.numel() * t.element_size() for _, t in named) / 1e6,
                 received_s - started_s, time.perf_counter() - received_s)
        return data

    async def _check_announced(self, names, dtypes, shapes) -> None:
        """400 before any allocation; the group is closed (the trainer's broadcast has no receiver)."""
        if self._validator is None:
            self._validator = await self.torch.run(weights.WeightValidator, self.core.model)
        try:
            await self.torch.run(self._validator.check_announced, names, dtypes, shapes)
        except ControlError as exc:
            await self.torch.run(self.close)
            raise ControlError(exc.status, f"{exc.message}; nothing was received and the weights update group "
                                           f"was closed: init it again", {"group_closed": True}) from None

    def _swap(self, named: weights.NamedTensors, flush_cache: bool, *, complete: bool = False, shadow=None) -> dict:
        """Validate everything, then copy (or swap in the shadow): a failure leaves the old weights.
        `flush_cache`: the scheduler drops the prefix cache (a kept one too) on success."""
        if self._validator is None:
            self._validator = weights.WeightValidator(self.core.model)
        names = self._validator.check(named, complete=complete)
        self.memory.before_weight_load()
        if shadow is None:
            weights.apply(self.core.model, named)
        else:
            shadow_weights, plan = shadow
            shadow_weights.swap_in(plan)
            weights.apply(self.core.model, [named[i] for i in plan.separate])
        self.memory.weights_loaded(names)
        if flush_cache:
            self.memory.forget_kv_scales()
        return {
            "num_tensors": len(named),
            "num_weights_missing": self.memory.num_missing_weights,
            "weights_asleep": WakeTag.WEIGHTS in self.memory.asleep,
            # INVARIANT: no proposer state computed before a weight change survives it.
            "draft": {**draft_weights.flush_draft_state(self.core), "weights": "kept"},
        }

    def _draft(self) -> draft_weights.DraftWeights:
        """The draft's updater (400 when the proposer has no model), built once."""
        if self._draft_weights is None:
            self._draft_weights = draft_weights.DraftWeights(self.core)
        return self._draft_weights

    def _draft_swap(self, draft: draft_weights.DraftWeights, named: weights.NamedTensors, *,
                    complete: bool = False) -> dict:
        """The draft's update: validate everything, copy, drop the state the old draft computed."""
        names = draft.check(named, complete=complete)
        draft.apply(named)
        return {"num_tensors": len(named), "num_draft_weights_updated": len(names),
                "draft": {**draft_weights.flush_draft_state(self.core), "weights": "updated"}}

    # -- update group ---------------------------------------------------------

    def _check_init(self, msg: InitWeightsUpdateGroup) -> None:
        if self._group is not None:
            raise ControlError(409, f"weights update group {self._group_name!r} is already open")
        if self._joining is not None:
            raise ControlError(409, f"weights update group {self._joining!r} is being formed")
        if msg.backend == "nccl" and self.core.device.type != "cuda":
            raise ControlError(400, "backend nccl needs a CUDA device; use gloo on CPU")
        if msg.backend not in ("gloo", "nccl"):
            raise ControlError(400, f"backend must be gloo or nccl, got {msg.backend!r}")
        if not msg.timeout_s > 0:
            raise ControlError(400, f"timeout_s must be > 0, got {msg.timeout_s}")
        if not 0 < msg.rank_offset < msg.world_size:
            raise ControlError(400, f"rank_offset must be in 1..world_size-1 (rank 0 is the trainer), got {msg.rank_offset}")

    async def _join(self, msg: InitWeightsUpdateGroup) -> None:
        """Background task: form the group, then send the reply (not when cancelled: shutdown)."""
        try:
            reply = await self._answer(msg, self._form_group)
        finally:
            self._joining = None
        await self._send(reply)

    async def _form_group(self, msg: InitWeightsUpdateGroup) -> dict:
        # SGLang's engine joins as rank_offset + tp_rank: a tensor-parallel rank r got its
        # rank_offset already moved by r (executor/tp_fanout.py).
        form = partial(update_group.open_group, msg.master_address, msg.master_port, msg.rank_offset,
                       msg.world_size, msg.group_name, msg.backend, msg.timeout_s)
        try:
            self._group = await group_join.form_off_thread(form, update_group.close_group,
                                                           "trillium-update-group-join")
        except ValueError as exc:  # torch: the name is taken in this process (a trainer beside an in-process engine)
            raise ControlError(409, f"weights update group {msg.group_name!r}: {exc}") from None
        self._group_name, self._group_backend = msg.group_name, msg.backend
        log.info("joined weights update group %r as rank %d of %d (%s)", msg.group_name, msg.rank_offset,
                 msg.world_size, msg.backend)
        return {"group_name": msg.group_name, "rank": msg.rank_offset, "world_size": msg.world_size}

    async def _destroy_group(self, msg: DestroyWeightsUpdateGroup) -> dict:
        if self._group is None:
            raise ControlError(409, "no weights update group is open")
        group, self._group = self._group, None
        self._release_shadow()
        await self.torch.run(update_group.close_group, group)
        return {"group_name": self._group_name}

    # -- LoRA adapters ---------------------------------------------------------------

    async def _load_lora(self, msg: LoadLoRAAdapter) -> dict:
        from trillium.lora import AdapterError

        if self.core.lora is None:
            raise ControlError(400, "LoRA is not enabled: start the server with --enable-lora")

        def load() -> dict:
            adapter = self.core.lora.register(msg.lora_id, msg.lora_name, msg.lora_path)
            return {"lora_rank": adapter.rank, "lora_target_modules": sorted(adapter.target_modules)}

        try:
            return await self.torch.run(load)
        except (AdapterError, OSError) as exc:
            raise ControlError(400, f"LoRA adapter {msg.lora_name!r}: {exc}") from None

    async def _unload_lora(self, msg: UnloadLoRAAdapter) -> dict:
        if self.core.lora is None or not await self.torch.run(self.core.lora.unregister, msg.lora_id):
            raise ControlError(404, f"LoRA adapter id {msg.lora_id} is not loaded")
        return {}

    # -- profiling ----------------------------------------------------------------

    async def _start_profile(self, msg: StartProfile) -> dict:
        if msg.timeline:
            try:
                self.timeline.start(msg.profile_dir, trio.current_time(), msg.max_duration_s, python_profile=False)
            except OSError as exc:
                raise ControlError(400, f"cannot use profile_dir {msg.profile_dir!r}: {exc}") from None
            self.core.stages.profiler = self.timeline
            return {"files": []}

        def start() -> None:
            self.profiler.start(msg.profile_dir, record_shapes=msg.record_shapes, with_stack=msg.with_stack)

        try:
            await self.torch.run(start)
        except OSError as exc:
            raise ControlError(400, f"cannot use profile_dir {msg.profile_dir!r}: {exc}") from None
        self.profiler.deadline = trio.current_time() + msg.max_duration_s
        return {"files": []}

    async def _stop_profile(self, msg: StopProfile) -> dict:
        self.core.stages.profiler = None
        try:
            return {"files": self.timeline.stop()}
        except NotProfiling:
            pass  # a torch.profiler session
        try:
            files = await self.torch.run(self.profiler.stop)
        except NotProfiling as exc:
            raise ControlError(409, str(exc)) from None
        self.profiler.deadline = math.inf
        return {"files": files}
