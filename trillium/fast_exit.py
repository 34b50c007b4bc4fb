"""Ending a server process without the interpreter's teardown.

`exit_now(code)` flushes the log handlers and the standard streams, then
leaves with `os._exit`. WHY: once a `trillium serve` process or an engine
actor child has stopped its work (sockets closed, the disk tier's writes
finished, traces flushed: each actor does that in its own `finally`), all
that is left is freeing what the process holds: a KV cache of gigabytes,
torch's and transformers' module graphs. Measured on the 2-core CI machine
that teardown took ~5 s per process, so the supervisor SIGKILLed children
past their grace period and every `serve` took ~10 s to stop. Nothing left
at that point needs the teardown: no atexit handler of ours does work, and
non-daemon threads are joined by the code that started them.

Only for a process's own last line: never call it from a library function
(trillium.LLM, tests) where the caller's process goes on.
"""

from __future__ import annotations

import logging
import os
import sys


def exit_now(code: int | None) -> None:
    """Flush logs and stdio, then `os._exit(code)` (None is 0)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # the stream is gone (a closed pipe): nothing more to write there
    os._exit(0 if code is None else int(code))


__all__ = ["exit_now"]
