"""Serve a QuartTrio app with Hypercorn's trio worker (both HTTP planes use it).

Lives outside data_plane/ and control_plane/ so neither plane imports the other.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

import hypercorn.trio
import trio
from hypercorn.config import Config as HypercornConfig
from quart_trio import QuartTrio

log = logging.getLogger(__name__)


def _bind_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"{host}:{port}"


async def serve_quart_app(
    app: QuartTrio,
    host: str,
    port: int,
    *,
    name: str,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    graceful_timeout_s: float = 5.0,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled or `shutdown_trigger` returns; started() reports the bound port."""
    config = HypercornConfig()
    config.bind = [_bind_address(host, port)]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = graceful_timeout_s
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            functools.partial(hypercorn.trio.serve, app, config, shutdown_trigger=shutdown_trigger)
        )
        bound_port = int(binds[0].rsplit(":", 1)[1])
        log.info("%s listening on %s", name, binds[0])
        task_status.started(bound_port)
