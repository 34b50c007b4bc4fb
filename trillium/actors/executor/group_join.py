"""Forming the weights update group off the step path: one rendezvous on a thread of its own.

`await form_off_thread(form, close)` runs `form()` (the blocking rendezvous
and group construction of `distributed/update_group.open_group`) on a new
daemon thread and returns its group, or raises what it raised.

WHY not the executor's torch thread: a rendezvous waits for the trainer,
up to the group's timeout; on the torch thread every step would queue
behind it (the engine froze while /health said 200). The join touches
nothing a step uses, so it may run beside them; torch's store and gloo
constructors release the GIL while they wait.

WHY not `trio.to_thread.run_sync(abandon_on_cancel=True)`: when the
executor shuts down mid-join, the caller is cancelled but the thread goes
on, and the group it may still form must be destroyed (a gloo group left
at interpreter exit aborts the process). Here the thread and the
cancelled caller agree under a lock: whichever comes second closes it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import trio

log = logging.getLogger(__name__)


class _Handoff:
    """What the thread made, and whether the caller still wants it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = False
        self.group: Any = None
        self.error: BaseException | None = None


async def form_off_thread(form: Callable[[], Any], close: Callable[[Any], None], name: str) -> Any:
    """form() on its own thread; a cancelled caller abandons it (and the group is closed)."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    handoff = _Handoff()

    def run() -> None:
        group, error = None, None
        try:
            group = form()
        except BaseException as exc:  # noqa: BLE001 - handed to the trio side
            error = exc
        with handoff.lock:
            if handoff.abandoned:
                if group is not None:
                    close(group)
                return
            handoff.group, handoff.error = group, error
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:  # the executor is gone; nothing waits any more
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    try:
        await done.wait()
    except BaseException:  # cancelled (shutdown): the thread's group, if any, is not ours to keep
        with handoff.lock:
            handoff.abandoned = True
            group, handoff.group = handoff.group, None
        if group is not None:
            close(group)
        raise
    if handoff.error is not None:
        raise handoff.error
    return handoff.group
