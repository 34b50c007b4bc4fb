"""The private directory of a server's ipc:// sockets, and the sweep of dead servers' ones.

`make_ipc_dir()` creates ``<tmp>/trillium-ipc-XXXXXXXX`` with mode 0700 (only
this user can reach the sockets in it; the link proof, link_auth.py, is what
keeps out other processes of the same user) and records its owner in
``owner.pid``: ``<pid> <start time>`` (the start time from /proc, in clock
ticks, so a recycled pid does not pass for the dead owner).

A server killed with SIGKILL leaves its directory (and socket files)
behind; `sweep_stale_ipc_dirs()`, run at every start, removes the ones of
this user whose owner is dead. A directory without a readable owner file,
of another user, or whose owner still runs is left alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile

log = logging.getLogger(__name__)

PREFIX = "trillium-ipc-"
OWNER_FILE = "owner.pid"


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/<pid>/stat), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def make_ipc_dir(root: str | None = None) -> str:
    """A fresh 0700 directory for this process's sockets, after sweeping the stale ones."""
    root = root or tempfile.gettempdir()
    sweep_stale_ipc_dirs(root)
    directory = tempfile.mkdtemp(prefix=PREFIX, dir=root)  # mode 0700
    os.chmod(directory, stat.S_IRWXU)
    pid = os.getpid()
    with open(os.path.join(directory, OWNER_FILE), "w") as f:
        f.write(f"{pid} {_start_time(pid) or 0}\n")
    return directory


def _owner_alive(directory: str) -> bool:
    try:
        with open(os.path.join(directory, OWNER_FILE)) as f:
            pid_text, start = f.read().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return True  # unknown owner: not ours to remove
    return _start_time(pid) == start


def sweep_stale_ipc_dirs(root: str | None = None) -> list[str]:
    """Remove this user's trillium-ipc-* directories whose owner is dead; the ones removed."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = os.listdir(root)
    except OSError:
        return removed
    for entry in entries:
        if not entry.startswith(PREFIX):
            continue
        path = os.path.join(root, entry)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or _owner_alive(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        log.info("removed %d stale ipc socket directories of dead servers: %s", len(removed), ", ".join(removed))
    return removed
