"""Python-level profile of an actor loop (scheduler, detokenizer).

`LoopProfiler` records, between start and stop:

- a cProfile of the actor's thread -> `<actor>-<pid>-<stamp>.prof`
  (open with `python -m pstats` or snakeviz);
- one chrome-trace span per handled message / step ->
  `<actor>-<pid>-<stamp>.trace.json` (chrome://tracing, Perfetto).

NOTE: cProfile hooks a whole thread. Actors that share one (an in-process
engine runs them all on one trio thread) cannot each have one: the first to
start takes it (and so profiles its neighbours too); the others record spans
only, and say so in their file list. Separate processes each get their own.

A profile is bounded in time: the owner calls `expire(now)` when `deadline`
passes; the files are then written and handed out by the next `stop()`.
Times are the caller's clock (trio's), so tests can use a MockClock.

A *timeline* profile (`start(..., python_profile=False)`) records the spans
only: no cProfile, so the loop runs at its normal speed, and the spans of
every actor line up on one clock (perf_counter_ns is CLOCK_MONOTONIC on
Linux, shared by the engine's processes). `bench/step_timeline.py` reads
them back (trillium/benchmarks/timeline_report.py).
"""

from __future__ import annotations

import contextlib
import cProfile
import json
import math
import os
import sys
import threading
import time

DEFAULT_MAX_PROFILE_S = 300.0
_MAX_SPANS = 1_000_000  # WHY: bounds memory if a profile runs on a busy engine
_NO_SPAN = contextlib.nullcontext()


class NotProfiling(Exception):
    """stop() without a profile started (or already collected)."""


def profile_file_stem(profile_dir: str, actor: str) -> str:
    """`<dir>/<actor>-<pid>-<UTC stamp, ms>`: unique across actors and processes."""
    now = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}"
    return os.path.join(profile_dir, f"{actor}-{os.getpid()}-{stamp}")


class LoopProfiler:
    def __init__(self, actor: str) -> None:
        self.actor = actor
        self.deadline = math.inf  # caller's clock; inf while not profiling
        self._dir: str | None = None
        self._cprofile: cProfile.Profile | None = None
        self._spans: list[tuple[str, int, int]] = []  # name, start ns, duration ns
        self._unreported: list[str] | None = None  # files of a profile that expired

    @property
    def active(self) -> bool:
        return self._dir is not None

    def start(self, profile_dir: str, now: float, max_duration_s: float = DEFAULT_MAX_PROFILE_S,
              *, python_profile: bool = True) -> None:
        """Start recording; OSError if `profile_dir` cannot be created. A
        profile still running is stopped first (its files are written).
        python_profile=False: spans only (a timeline), no cProfile."""
        if self.active:
            self._finish()
        os.makedirs(profile_dir, exist_ok=True)
        self._dir = profile_dir
        self._spans = []
        self._unreported = None
        self.deadline = now + max_duration_s
        if python_profile and sys.getprofile() is None:  # else a neighbour on this thread holds it
            self._cprofile = cProfile.Profile()
            self._cprofile.enable()

    def span(self, name: str):
        """Context manager timing one unit of loop work (free when inactive)."""
        if self._dir is None or len(self._spans) >= _MAX_SPANS:
            return _NO_SPAN
        return self._timed(name)

    def record(self, name: str, start_ns: int, end_ns: int) -> None:
        """One span measured by the caller (perf_counter_ns); dropped when inactive.
        NOTE: callable from another thread (the executor's torch thread): a list
        append is atomic under the GIL."""
        if self._dir is not None and len(self._spans) < _MAX_SPANS:
            self._spans.append((name, start_ns, end_ns - start_ns))

    @contextlib.contextmanager
    def _timed(self, name: str):
        start_ns = time.perf_counter_ns()
        try:
            yield
        finally:
            self._spans.append((name, start_ns, time.perf_counter_ns() - start_ns))

    def stop(self) -> list[str]:
        """Stop and return the files written; NotProfiling if there is no profile."""
        if self.active:
            return self._finish()
        if self._unreported is not None:
            files, self._unreported = self._unreported, None
            return files
        raise NotProfiling(f"{self.actor}: no profile is running")

    def expire(self, now: float) -> bool:
        """Stop a profile whose deadline passed; its files wait for stop()."""
        if not self.active or now < self.deadline:
            return False
        self._unreported = self._finish()
        return True

    def close(self) -> None:
        """The actor is going away: unhook cProfile from the thread, write nothing."""
        if self._cprofile is not None:
            self._cprofile.disable()
        self._dir, self._cprofile, self._spans = None, None, []
        self.deadline = math.inf

    def _finish(self) -> list[str]:
        # NOTE: writes on the caller's thread (the actor loop): once per
        # profile, a few MB at most.
        stem = profile_file_stem(self._dir, self.actor)
        files = []
        if self._cprofile is not None:
            self._cprofile.disable()
            self._cprofile.dump_stats(stem + ".prof")
            files.append(stem + ".prof")
        with open(stem + ".trace.json", "w") as f:
            json.dump(self._chrome_trace(), f)
        files.append(stem + ".trace.json")
        self._dir, self._cprofile, self._spans = None, None, []
        self.deadline = math.inf
        return files

    def _chrome_trace(self) -> dict:
        pid, tid = os.getpid(), threading.get_native_id()
        events = [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": self.actor}}]
        events += [
            {"name": name, "ph": "X", "ts": start / 1e3, "dur": dur / 1e3, "pid": pid, "tid": tid}
            for name, start, dur in self._spans
        ]
        return {"traceEvents": events, "displayTimeUnit": "ms"}
