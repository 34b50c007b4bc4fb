"""torch.profiler for the executor: start / stop on the torch thread, chrome trace out.

`TorchProfiler.start` and `.stop` must run on the executor's torch thread
(where every step runs), so the profile sees the steps' ops. The trace is
`<profile_dir>/executor-<pid>-<stamp>.pt.trace.json` (chrome://tracing,
Perfetto, TensorBoard); under tensor parallelism each rank writes its own,
`executor-rank<r>-<pid>-<stamp>.pt.trace.json` (`name`). Like `observability.profiling.LoopProfiler`, a
profile is bounded in time: the actor calls `expire` once `deadline` (its
trio clock) has passed, and the next `stop` hands out that file.

`StageClock` is the executor core's hook for a *timeline* profile
(StartProfile.timeline): `begin()` at a step's start and `mark(stage)` at each
stage's end record one span per stage into the running `LoopProfiler`; with
none running each call is one attribute test.
"""

from __future__ import annotations

import math
import os
import time

import torch

from trillium.observability.profiling import LoopProfiler, NotProfiling, profile_file_stem


class StageClock:
    """A step's stages (inputs, forward, sample, result) as spans of a timeline."""

    __slots__ = ("profiler", "_last_ns")

    def __init__(self) -> None:
        self.profiler: LoopProfiler | None = None  # set while a timeline profile runs
        self._last_ns = 0

    def begin(self) -> None:
        if self.profiler is not None:
            self._last_ns = time.perf_counter_ns()

    def mark(self, stage: str) -> None:
        """The span from the previous mark (or begin) to now is `stage`."""
        if self.profiler is not None:
            now = time.perf_counter_ns()
            self.profiler.record(stage, self._last_ns, now)
            self._last_ns = now


class TorchProfiler:
    def __init__(self, device: torch.device, name: str = "executor") -> None:
        self.device = device
        self.name = name  # the file's prefix: "executor", or "executor-rank<r>" under TP
        self.deadline = math.inf
        self._profile = None
        self._dir: str | None = None
        self._unreported: list[str] | None = None

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self, profile_dir: str, *, record_shapes: bool, with_stack: bool) -> None:
        """OSError if `profile_dir` cannot be created; a running profile is written first."""
        if self.active:
            self._finish()
        os.makedirs(profile_dir, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, record_shapes=record_shapes, with_stack=with_stack)
        profile.start()
        self._profile, self._dir, self._unreported = profile, profile_dir, None

    def stop(self) -> list[str]:
        if self.active:
            return self._finish()
        if self._unreported is not None:
            files, self._unreported = self._unreported, None
            return files
        raise NotProfiling("executor: no profile is running")

    def discard(self) -> None:
        """Stop without writing (the executor is shutting down)."""
        profile, self._profile = self._profile, None
        self.deadline = math.inf
        if profile is not None:
            profile.stop()

    def expire(self) -> None:
        if self.active:
            self._unreported = self._finish()

    def _finish(self) -> list[str]:
        profile, self._profile = self._profile, None
        self.deadline = math.inf
        profile.stop()
        path = profile_file_stem(self._dir, self.name) + ".pt.trace.json"
        profile.export_chrome_trace(path)
        return [path]
