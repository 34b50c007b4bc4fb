"""One long-lived thread for all of an actor's torch work.

WHY: torch's CPU ops run on OpenMP, whose thread pool belongs to the thread
that starts a parallel region. `trio.to_thread` may hand work to different
cached threads; each new one brings its own OpenMP pool, and once the pool
threads outnumber the cores libgomp throttles its spin-waiting, which slowed
decode steps by ~20% here. Running every call on the same thread keeps one
pool. The trio side awaits a result without blocking its loop.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")


class TorchThread:
    def __init__(self, name: str = "trillium-torch") -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Run fn(*args) on the torch thread; await its result (not cancellable mid-call)."""
        return await self.wait(self.submit(fn, *args))

    def submit(self, fn: Callable[..., T], *args) -> concurrent.futures.Future:
        """Queue fn(*args) behind the calls already queued (they run in order); `wait` for it."""
        return self._pool.submit(fn, *args)

    @staticmethod
    async def wait(future: concurrent.futures.Future):
        """The result of a `submit`ted call (its exception re-raised), without blocking the loop."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        future.add_done_callback(lambda _: token.run_sync_soon(done.set))
        with trio.CancelScope(shield=True):
            # NOTE: torch work cannot be interrupted; a cancelled caller still
            # waits for the call to end, so state is never left half-written.
            await done.wait()
        return future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
