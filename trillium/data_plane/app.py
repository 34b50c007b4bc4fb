"""The OpenAI-compatible data plane: a QuartTrio app and its Hypercorn server.

Public API (stable; `trillium serve` builds on it):

    create_app(engine: DataPlaneEngine) -> QuartTrio
        One app per engine bundle (see `context.py`). Routes: GET /v1/models,
        /v1/models/<name>, POST /v1/completions, /v1/chat/completions, /v1/responses
        (+ GET/DELETE /v1/responses/<id>, POST .../cancel: routes/responses.py),
        SGLang's /generate, /tokenize, /detokenize, GET /health, /version, /metrics,
        /openapi.json, TRL vllm-serve's GET /health/, POST /generate/ (routes/trl.py),
        Anthropic's POST /v1/messages, /v1/messages/count_tokens (routes/messages.py); for a pooling model /v1/embeddings, /pooling,
        /classify (routes/pooling.py), /score, /rerank (routes/scores.py). The app owns its
        tokenizer threads, admission control and Prometheus registry; it never starts or stops the
        engine (the caller runs `EngineClient.run` and the actors).

    async serve_app(app, host, port, *, shutdown_trigger=None,
                    graceful_timeout_s=5.0, task_status=trio.TASK_STATUS_IGNORED)
        Serve `app` with Hypercorn's trio worker until cancelled or until
        `shutdown_trigger()` returns. `await nursery.start(serve_app, app,
        host, port)` returns the bound port (port 0 binds a free one).
        Graceful stop: let `shutdown_trigger` return; the listener closes
        and in-flight requests get `graceful_timeout_s` to finish. Hard stop:
        cancel the task; in-flight engine requests are aborted either way.

Every error, including unknown routes and unexpected exceptions, is
OpenAI's `{"error": {...}}` JSON (Anthropic's `{"type": "error", "error": {...}}`
under /v1/messages). With `engine.api_key` set, `/v1/*`,
`/generate` (and TRL's `/generate/`), /tokenize, /detokenize and /metrics need `Authorization: Bearer
<key>` or Anthropic's `x-api-key: <key>` (/metrics stays open with `limits.metrics_without_auth`, for
scrapers); /health, /version and /openapi.json stay open. The key is checked
before the body is read: a refused request's body is read only up to 1 MiB
(to keep its keep-alive connection in step, as the admin plane does) and
the connection is closed. Bodies are capped at `limits.max_body_bytes`
(413), and `limits.max_connections` requests at once are served
(connections.py: one more gets 503 and a closed connection).

The data plane never imports the control plane (and vice versa): both talk
to the engine through the same client.
"""

from __future__ import annotations

import functools
import hmac
import logging
from collections.abc import Awaitable, Callable

import trio
from quart import request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from trillium.data_plane.anthropic_messages import MESSAGES_PATH, error_response
from trillium.data_plane.connections import ConnectionLimit
from trillium.actors.client import EngineFailed
from trillium.data_plane.context import DataPlaneEngine
from trillium.data_plane.errors import (
    INVALID_REQUEST,
    ApiError,
    engine_failed,
    internal_error,
    unauthorized,
)
from trillium.data_plane.routes import (
    chat,
    completions,
    generate,
    health,
    messages,
    metrics,
    models,
    openapi,
    pooling,
    responses,
    scores,
    tokenize,
    trl,
)
from trillium.data_plane.state import AppState
from trillium.http_serving import serve_quart_app

log = logging.getLogger(__name__)

STATE_KEY = "trillium.data_plane"
# Open with --api-key too: probes and the API's own description.
_OPEN_PATHS = frozenset({"/health", "/version", "/openapi.json"})
# WHY: a refused client's small body is read so its keep-alive connection stays in
# step; a larger one is not read at all and the connection closes (errors.unauthorized).
_READ_REFUSED_BODY_MAX_BYTES = 1 << 20
_ROUTE_MODULES = (models, completions, chat, generate, tokenize, health, metrics, openapi, trl, messages,
                  responses, pooling, scores)


def create_app(engine: DataPlaneEngine) -> QuartTrio:
    app = QuartTrio("trillium.data_plane")
    # WHY: a long generation streams for minutes; Quart's default 60 s send timeout would cut it.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = engine.limits.max_body_bytes
    app.asgi_app = ConnectionLimit(app.asgi_app, engine.limits.max_connections)
    state = AppState(engine, app)
    app.extensions[STATE_KEY] = state
    for module in _ROUTE_MODULES:
        app.register_blueprint(module.blueprint(state))
    if engine.api_key:  # WHY first: an unauthenticated body is not read (see the module docstring)
        open_paths = _OPEN_PATHS | ({"/metrics"} if engine.limits.metrics_without_auth else set())
        app.before_request(functools.partial(_check_api_key, engine.api_key, frozenset(open_paths)))
    app.before_request(_read_body)
    app.after_request(_echo_request_id)
    app.register_error_handler(ApiError, _api_error)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(EngineFailed, _engine_failed)
    app.register_error_handler(Exception, _unexpected_error)
    return app


def app_state(app: QuartTrio) -> AppState:
    """The state `create_app` built (for tests and the server's own probes)."""
    return app.extensions[STATE_KEY]


async def _read_body() -> None:
    # WHY: answering (401, 404, 405) before the request body was read leaves
    # Hypercorn's keep-alive connection stuck: the client's next request on it
    # never gets a response. Reading it first (bounded by MAX_CONTENT_LENGTH;
    # Quart caches it for the route) keeps the connection in step.
    await request.get_data()


async def _echo_request_id(response):
    # vLLM's --enable-request-id-headers: a client's X-Request-Id comes back on
    # every response, errors included (the generation routes set it themselves).
    request_id = request.headers.get("X-Request-Id")
    if request_id and "X-Request-Id" not in response.headers:
        response.headers["X-Request-Id"] = request_id
    return response


async def _check_api_key(api_key: str, open_paths: frozenset[str]) -> None:
    # WHY every other path: /generate generates like /v1/completions (SGLang's --api-key
    # guards it too); tokenizing is work, and /metrics tells the load and the models.
    if request.path in open_paths:
        return
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return
    # Anthropic's clients send the key as x-api-key (the anthropic SDK, Claude Code).
    x_api_key = request.headers.get("x-api-key")
    if x_api_key is not None and hmac.compare_digest(x_api_key.strip().encode(), api_key.encode()):
        return
    length = request.content_length
    if length is not None and length <= _READ_REFUSED_BODY_MAX_BYTES:
        await request.get_data()
    raise unauthorized()


def _render(error: ApiError):
    """The error in the shape of the API its path belongs to."""
    if request.path == MESSAGES_PATH or request.path.startswith(MESSAGES_PATH + "/"):
        return error_response(error)
    return error.to_response()


async def _api_error(error: ApiError):
    return _render(error)


async def _http_error(error: HTTPException):
    kind = "not_found_error" if error.code == 404 else INVALID_REQUEST
    message = f"{error.name}: {request.method} {request.path}" if error.code in (404, 405) else error.description
    return _render(ApiError(error.code or 500, message, type=kind, code=error.code))


async def _engine_failed(error: EngineFailed):
    return _render(engine_failed(str(error)))


async def _unexpected_error(error: Exception):
    log.error("unhandled error in %s %s", request.method, request.path, exc_info=error)
    return _render(internal_error())


async def serve_app(
    app: QuartTrio,
    host: str,
    port: int,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    graceful_timeout_s: float = 5.0,
    certfile: str | None = None,
    keyfile: str | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled or `shutdown_trigger` returns; started() reports the bound port.
    `certfile` + `keyfile` (PEM): HTTPS instead of HTTP."""
    await serve_quart_app(
        app, host, port, name="data plane", shutdown_trigger=shutdown_trigger,
        graceful_timeout_s=graceful_timeout_s, certfile=certfile, keyfile=keyfile, task_status=task_status,
    )
