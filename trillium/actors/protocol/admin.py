"""api -> scheduler -> executor: engine lifecycle and weight commands (control plane).

Pattern: the api (control plane) PUSHes a command to the scheduler inbox;
the scheduler applies it to the engine state machine
(`scheduler/engine_state.py`, `scheduler/control.py`), forwards executor work
(sleep, wake, weight loads, update groups, profiling) to the executor inbox
between steps, and PUSHes one `ControlReply` with the same `command_id` to
the api inbox, right after a `SchedulerStats` that already shows the new
state. The executor replies to the scheduler with `ControlReply` too; the
detokenizer answers forwarded StartProfile / StopProfile the same way. A
forwarded command keeps its class; its `command_id` gets "@<actor>" appended
(e.g. "c7@executor") so the scheduler can tell the answers apart.

WHY through the scheduler: it is the only sender of ExecuteBatch, so a
command it forwards runs strictly between two steps. No step ever runs on a
mix of old and new weights, and sleep never frees memory under a running
forward.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from trillium.actors.protocol.execute import NO_TRANSFERS, KvTransfers
from trillium.actors.protocol.vocabulary import ALL_WAKE_TAGS, PauseMode, WakeTag


@attrs.frozen
class Sleep:
    """The fields after `mode` are the scheduler's, on the forwarded command only
    (--sleep-keep-prefix-cache, level 1): the prefix cache survives in the
    host KV tier. Before freeing the KV cache the executor applies `kv` (the
    disk tier's queued operations, then the saves of the spilled device
    blocks into host slots; execute.KvTransfers), and it keeps the fp8 KV
    scales for the wake (the host blocks were written with them)."""

    command_id: str
    level: int  # 1: weights to host memory + KV freed; 2: weights and KV freed
    mode: PauseMode = PauseMode.ABORT  # what happens to requests in flight
    keep_prefix_cache: bool = False
    kv: KvTransfers = attrs.field(factory=lambda: NO_TRANSFERS)


@attrs.frozen
class WakeUp:
    command_id: str
    tags: tuple[WakeTag, ...] = ALL_WAKE_TAGS


@attrs.frozen
class Pause:
    command_id: str
    mode: PauseMode = PauseMode.ABORT


@attrs.frozen
class Resume:
    command_id: str


@attrs.frozen
class UpdateWeightsFromDisk:
    """Every weight update (from disk, tensors or distributed) has
    `drain_timeout_s`: sent while serving, the scheduler first drains (the
    requests it holds finish on the old weights, up to this long, then the
    rest are aborted); None: no drain, the update runs after the step in
    flight and the requests carry on over the new weights."""

    command_id: str
    model_path: str
    weight_version: str | None = None
    flush_cache: bool = True
    drain_timeout_s: float | None = None
    # True: the update is the speculative draft's (draft model or EAGLE head), not the
    # target's: its own weight version, the target's weights untouched (speculative/draft_weights.py).
    draft_model_only: bool = False


@attrs.frozen
class UpdateWeightsFromTensors:
    """`safetensors` is the raw bytes of a safetensors file (uint8 array,
    travels as a frame), or empty with `safetensors_path` naming the file the
    api streamed an upload into (read once by the executor, never copied
    through the sockets); the executor parses it with the safetensors library."""

    command_id: str
    safetensors: np.ndarray
    weight_version: str | None = None
    flush_cache: bool = True
    drain_timeout_s: float | None = None
    safetensors_path: str | None = None
    draft_model_only: bool = False  # as UpdateWeightsFromDisk's


@attrs.frozen
class InitWeightsUpdateGroup:
    command_id: str
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"
    timeout_s: float = 60.0


@attrs.frozen
class UpdateWeightsFromDistributed:
    command_id: str
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    weight_version: str | None = None
    flush_cache: bool = True
    drain_timeout_s: float | None = None
    group_name: str | None = None  # SGLang's clients name the group; None: the open one


@attrs.frozen
class DestroyWeightsUpdateGroup:
    command_id: str
    group_name: str | None = None  # as above


@attrs.frozen
class ResetPrefixCache:
    command_id: str


@attrs.frozen
class SetWeightVersion:
    """Rename the weights being served (SGLang's update_weight_version): only
    the label changes; the weights, KV cache and prefix cache stay as they are."""

    command_id: str
    weight_version: str


@attrs.frozen
class AbortRequests:
    command_id: str
    request_ids: tuple[str, ...] | None = None  # None: every request


@attrs.frozen
class StartProfile:
    """Each actor writes its files under `profile_dir` when the profile stops:
    by StopProfile, or by itself after `max_duration_s`."""

    command_id: str
    profile_dir: str
    actors: tuple[str, ...] = ("executor", "scheduler", "detokenizer")
    record_shapes: bool = False
    with_stack: bool = False
    max_duration_s: float = 300.0
    # A step timeline: spans only, no cProfile / torch.profiler (the engine runs at
    # its normal speed); the executor records its step's stages (bench/step_timeline.py).
    timeline: bool = False


@attrs.frozen
class StopProfile:
    command_id: str


@attrs.frozen
class LoadLoRAAdapter:
    """Register adapter `lora_id` (>= 1; requests name it in AddRequest.lora_id).
    The executor reads and validates it (400 if it cannot be served)."""

    command_id: str
    lora_id: int
    lora_name: str
    lora_path: str


@attrs.frozen
class UnloadLoRAAdapter:
    """Forget adapter `lora_id`; 409 while a request of the engine still uses it
    (the api aborts or waits for them first, as the caller's mode says)."""

    command_id: str
    lora_id: int


@attrs.frozen
class GetEngineInfo:
    command_id: str


@attrs.frozen
class ControlReply:
    """status follows HTTP: 200 ok, 400 bad argument, 403 forbidden path,
    409 not allowed in the current state (message names it), 500 failure,
    504 a trainer (update group) or the engine did not answer in time.
    `data` of every engine reply holds GetEngineInfo's fields (state,
    weight_version, ...) plus what the command itself reports."""

    command_id: str
    status: int = 200
    message: str = ""
    data: dict[str, Any] = attrs.field(factory=dict)

    @property
    def ok(self) -> bool:
        return self.status < 400


class ControlError(Exception):
    """Raised by a command handler; becomes `ControlReply(status, message)`.

    Not a message: it never crosses a boundary, only its reply does."""

    def __init__(self, status: int, message: str, data: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.data = data or {}

    def reply(self, command_id: str, data: dict[str, Any] | None = None) -> ControlReply:
        return ControlReply(command_id, self.status, self.message, {**(data or {}), **self.data})


MESSAGES = (
    Sleep,
    WakeUp,
    Pause,
    Resume,
    UpdateWeightsFromDisk,
    UpdateWeightsFromTensors,
    InitWeightsUpdateGroup,
    UpdateWeightsFromDistributed,
    DestroyWeightsUpdateGroup,
    ResetPrefixCache,
    SetWeightVersion,
    AbortRequests,
    StartProfile,
    StopProfile,
    LoadLoRAAdapter,
    UnloadLoRAAdapter,
    GetEngineInfo,
    ControlReply,
)
