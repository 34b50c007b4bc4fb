"""--max-queue-time-s: waiting requests that never ran are dropped after a deadline.

A component of the scheduler core (core.py calls `expired` at the start of
each `schedule()`; it keeps no request state of its own). A request that
waited longer than `max_queue_time_s` since its api arrival, and never
reached the executor, ends with finish_reason "abort" and a stop_reason
starting with QUEUE_TIMEOUT_REASON, which the api turns into a 503 with
Retry-After (data_plane/errors.py `rejection_error`). A request that ran
before (preempted, swapped) is never dropped: it holds a client's partial
output, and dropping it would waste the work already done.

`NO_QUEUE_TIMEOUT` is the null object when the flag is 0 (the default).
The scan is over the waiting queue (bounded by --max-queued-requests) and
runs at most every CHECK_INTERVAL_S, so it costs nothing per step.

Pure synchronous code: times are wall clock seconds passed in.
"""

from __future__ import annotations

from collections.abc import Iterable

from trillium.actors.protocol.vocabulary import QUEUE_TIMEOUT_REASON
from trillium.actors.scheduler.request import Request, RequestStatus
CHECK_INTERVAL_S = 0.05


class QueueTimeout:
    def __init__(self, max_queue_time_s: float) -> None:
        if max_queue_time_s < 0:
            raise ValueError(f"--max-queue-time-s must be >= 0, got {max_queue_time_s}")
        self.max_queue_time_s = max_queue_time_s
        self._next_check_s = 0.0

    def expired(self, waiting: Iterable[Request], now_s: float) -> list[Request]:
        """Waiting requests past their deadline, each with its stop_reason set."""
        if not self.max_queue_time_s or now_s < self._next_check_s:
            return []
        self._next_check_s = now_s + CHECK_INTERVAL_S
        deadline_s = now_s - self.max_queue_time_s
        out = [r for r in waiting
               if r.status is RequestStatus.WAITING and not r.known_to_executor and r.arrival_time < deadline_s]
        for request in out:
            request.stop_reason = (f"{QUEUE_TIMEOUT_REASON}: waited {now_s - request.arrival_time:.1f} s in the "
                                   f"queue, longer than --max-queue-time-s {self.max_queue_time_s:g}")
        return out


NO_QUEUE_TIMEOUT = QueueTimeout(0.0)
