"""The admin / RLHF control plane: a QuartTrio app on its own port, and its server.

Public API (`trillium serve` builds on it):

    create_admin_app(engine: ControlPlaneEngine) -> QuartTrio
        Routes (SGLang / vLLM names, JSON in and out):
          POST /sleep, /wake_up; GET /is_sleeping
          POST /pause, /resume; GET /is_paused
          POST /update_weights_from_disk, /update_weights_from_tensor; GET /weight_version
          POST /init_weights_update_group, /update_weights_from_distributed,
               /destroy_weights_update_group
          POST /start_profile, /stop_profile
          POST /reset_prefix_cache, /abort_requests
          POST /v1/load_lora_adapter, /v1/unload_lora_adapter
          GET, POST /tracing
          GET /server_info, /health, /metrics
        and SGLang's names for the same operations:
          POST /pause_generation, /continue_generation
          GET, POST /release_memory_occupation, /resume_memory_occupation, /flush_cache
          POST /abort_request, /update_weight_version, /load_lora_adapter, /unload_lora_adapter
          GET /get_weight_version, /health_generate, /get_server_info, /get_model_info,
              /get_load, /v1/loads
        RL frameworks' own routes (one module each): AReaL's /areal_* (routes/areal.py),
        prime-rl's POST /update_weights (routes/prime_rl.py), TRL vllm-serve's
        /get_world_size/, /reset_prefix_cache/, /init_communicator/ (a 400: NCCL only),
        /update_named_param/ (400), /close_communicator/ (routes/trl.py).
        vLLM's query-string forms (/sleep?level=2, /wake_up?tags=weights,
        /pause?mode=keep, /reset_prefix_cache?reset_external=true) mean what
        they mean in vLLM; a query parameter a route does not take is a 400
        (query.py). Every route, /health and /metrics included, requires
        `Authorization: Bearer <engine.admin_token>`; anything else is 401.

    data_port_mount(app, *, require_token) -> ASGI app
        The same app (same state, lock and metrics) as the data port serves
        it under `--admin-on-data-port`; `require_token=False` (a loopback
        server started without an admin token) skips the bearer check there.
        `trillium serve` routes the admin paths of the data port to it.

    async serve_admin_app(app, host, port, *, shutdown_trigger=None,
                          graceful_timeout_s=5.0, task_status=...)
        Hypercorn's trio worker; `await nursery.start(...)` returns the bound
        port (port 0 binds a free one).

Errors use the data plane's JSON shape `{"error": {message, type, param,
code}}`; an engine error reply keeps its status (400 / 403 / 409 / 500 /
504). Never imports `trillium.data_plane`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

import trio
from quart import request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from trillium.control_plane.auth import check_bearer
from trillium.control_plane.context import ControlPlaneEngine
from trillium.control_plane.errors import AdminError, internal_error, unauthorized
from trillium.control_plane.query import reject_unknown_query
from trillium.control_plane.routes import (
    abort,
    areal,
    distributed,
    health,
    loads,
    lora,
    metrics,
    pause,
    prefix_cache,
    prime_rl,
    profiling,
    server_info,
    sleep,
    tracing,
    trl,
    weights,
)
from trillium.control_plane.state import AdminState
from trillium.http_serving import serve_quart_app

log = logging.getLogger(__name__)

STATE_KEY = "trillium.control_plane"
_ROUTE_MODULES = (sleep, pause, weights, distributed, profiling, prefix_cache, abort, server_info, health, metrics,
                  tracing, lora, loads, areal, prime_rl, trl)
# A scope key only `data_port_mount` sets (a client cannot: it is not a header).
_OPEN_SCOPE_KEY = "trillium.admin_without_token"
# WHY: a refused client's small body is read so its keep-alive connection stays in
# step; a large one (an unauthenticated upload) is not read, the connection closes.
_READ_REFUSED_BODY_MAX_BYTES = 1 << 20
_BODY_TIMEOUT_S = 600  # a multi-GB safetensors upload


def create_admin_app(engine: ControlPlaneEngine) -> QuartTrio:
    app = QuartTrio("trillium.control_plane")
    app.config["RESPONSE_TIMEOUT"] = None  # WHY: a weight load or a drain can outlast Quart's 60 s
    app.config["BODY_TIMEOUT"] = _BODY_TIMEOUT_S
    app.config["MAX_CONTENT_LENGTH"] = engine.max_body_bytes
    state = AdminState(engine)
    app.extensions[STATE_KEY] = state
    for module in _ROUTE_MODULES:
        app.register_blueprint(module.blueprint(state))
    app.before_request(functools.partial(_authenticate, engine.admin_token))
    app.before_request(reject_unknown_query)  # WHY after: an unauthenticated client learns nothing
    app.register_error_handler(AdminError, _admin_error)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _unexpected_error)
    return app


def admin_state(app: QuartTrio) -> AdminState:
    """The state `create_admin_app` built (for tests and the server's own probes)."""
    return app.extensions[STATE_KEY]


def data_port_mount(app: QuartTrio, *, require_token: bool):
    """`app` as the data port serves it (see the module docstring)."""

    async def mounted(scope, receive, send) -> None:
        if scope["type"] == "http":
            scope = {**scope, _OPEN_SCOPE_KEY: not require_token}
        await app(scope, receive, send)

    return mounted


async def _authenticate(token: str) -> None:
    if request.scope.get(_OPEN_SCOPE_KEY) is True:
        return
    if check_bearer(request.headers.get("Authorization"), token):
        return
    length = request.content_length
    if length is not None and length <= _READ_REFUSED_BODY_MAX_BYTES:
        await request.get_data()
    log.warning("admin: refused %s %s from %s (bad or missing token)", request.method, request.path,
                request.remote_addr)
    raise unauthorized()


async def _admin_error(error: AdminError):
    return error.to_response()


async def _http_error(error: HTTPException):
    message = f"{error.name}: {request.method} {request.path}" if error.code in (404, 405) else error.description
    return AdminError(error.code or 500, message, code=error.code).to_response()


async def _unexpected_error(error: Exception):
    log.error("unhandled error in %s %s", request.method, request.path, exc_info=error)
    return internal_error().to_response()


async def serve_admin_app(
    app: QuartTrio,
    host: str,
    port: int,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    graceful_timeout_s: float = 5.0,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled or `shutdown_trigger` returns; started() reports the bound port."""
    await serve_quart_app(
        app, host, port, name="control plane", shutdown_trigger=shutdown_trigger,
        graceful_timeout_s=graceful_timeout_s, task_status=task_status,
    )
