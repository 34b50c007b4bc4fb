"""Bounded polling for what a test cannot await: a real subprocess, an HTTP server, another thread.

`wait_until(condition, timeout_s=..., interval_s=..., what=...)` calls
`condition()` every `interval_s` until it is true and raises `TimeoutError`
naming `what` once `timeout_s` has passed; `wait_until_async` is the same
under trio. Exceptions listed in `ignoring` (a server that does not answer
yet) count as "not yet"; any other exception from the condition ends the wait
at once (a server process that exited). `detail()`, if given, is appended to
the timeout message (a server's log).

NOTE: in-process state under trio should be awaited (an event, a channel, a
reply), not polled; these helpers are for real time, which is unavoidable
there.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import trio

Condition = Callable[[], object]


def wait_until(
    condition: Condition,
    *,
    timeout_s: float,
    interval_s: float,
    what: str,
    ignoring: tuple[type[BaseException], ...] = (),
    detail: Callable[[], str] | None = None,
) -> None:
    """Poll `condition` with time.sleep until it is true; TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(*ignoring):
            if condition():
                return
        if time.monotonic() > deadline:
            raise TimeoutError(_timeout_message(what, timeout_s, detail))
        time.sleep(interval_s)


async def wait_until_async(
    condition: Condition,
    *,
    timeout_s: float,
    interval_s: float,
    what: str,
    detail: Callable[[], str] | None = None,
) -> None:
    """Poll `condition` with trio.sleep until it is true; TimeoutError after timeout_s."""
    deadline = trio.current_time() + timeout_s
    while not condition():
        if trio.current_time() > deadline:
            raise TimeoutError(_timeout_message(what, timeout_s, detail))
        await trio.sleep(interval_s)


def _timeout_message(what: str, timeout_s: float, detail: Callable[[], str] | None) -> str:
    message = f"timed out after {timeout_s}s waiting for {what}"
    return message if detail is None else f"{message}:\n{detail()}"
