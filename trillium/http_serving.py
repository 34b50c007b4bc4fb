"""Serve a QuartTrio app with Hypercorn's trio worker (both HTTP planes use it).

`by_path(primary, secondary, paths)` is one ASGI app for one port that sends
HTTP requests for `paths` to `secondary` and everything else (lifespan
included) to `primary`: how `trillium serve --admin-on-data-port` puts the
admin routes on the data port. `exclusive_paths(app, other)` lists an app's
fixed route paths that `other` does not have (so on a shared port the data
plane keeps its /health and /metrics).

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


def _fixed_paths(app: QuartTrio) -> set[str]:
    return {rule.rule for rule in app.url_map.iter_rules() if "<" not in rule.rule}


def exclusive_paths(app: QuartTrio, other: QuartTrio) -> frozenset[str]:
    """The fixed (variable-free) route paths of `app` that `other` has no route for."""
    taken = {rule.rule for rule in other.url_map.iter_rules()}
    return frozenset(_fixed_paths(app) - taken)


def by_path(primary, secondary, paths: frozenset[str]):
    """One ASGI app: HTTP requests whose path is in `paths` go to `secondary`, the rest to `primary`.

    NOTE: lifespan goes to `primary` only; `secondary` must run its own
    (it is also served on its own port, which starts it)."""

    async def route(scope, receive, send) -> None:
        target = secondary if scope["type"] == "http" and scope["path"] in paths else primary
        await target(scope, receive, send)

    return route


def _bind_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"{host}:{port}"


async def serve_quart_app(
    app: QuartTrio | Callable,  # a QuartTrio app or any ASGI app (by_path)
    host: str,
    port: int,
    *,
    name: str,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    graceful_timeout_s: float = 5.0,
    certfile: str | None = None,
    keyfile: str | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled or `shutdown_trigger` returns; started() reports the bound port.
    `certfile` + `keyfile` (PEM files): TLS (vLLM's --ssl-certfile / --ssl-keyfile)."""
    config = HypercornConfig()
    config.certfile = certfile
    config.keyfile = keyfile
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
