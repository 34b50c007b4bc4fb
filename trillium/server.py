"""`trillium serve`: the supervisor of DESIGN.md §2.

Process layout (one host):

    trillium serve (this process, "api")   HTTP data plane, tokenizer, EngineClient
      ├─ executor     child process         weights, KV cache, forward + sampling
      ├─ detokenizer  child process         incremental detokenization, stop strings
      └─ scheduler    child process         batching, KV block pool, prefix cache

Actors talk over ipc:// sockets in a private temp dir. If any child dies,
the supervisor raises ActorFailed: /health turns 503 for the instant it
takes, every other child is stopped, and the server exits non-zero with the
cause logged. SIGTERM / Ctrl-C stops accepting connections, lets in-flight
requests finish for `--shutdown-timeout` seconds, then stops every child.
"""

from __future__ import annotations

import functools
import logging
import shutil
import signal
import tempfile

import attrs
import trio

from trillium.actors.client import EngineClient
from trillium.actors.engine import ActorConfig, Addresses, engine_specs
from trillium.actors.supervisor import ActorFailed, Supervision, run_in_subprocesses
from trillium.config import EngineConfig

log = logging.getLogger("trillium.serve")


@attrs.frozen
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queued_requests: int | None = None
    shutdown_timeout_s: float = 10.0


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Resolve the config, run until a signal or an actor failure; exit code."""
    engine_config = engine_config.resolve()
    try:
        trio.run(_serve, engine_config, server_config)
    except ActorFailed as exc:
        log.error("engine actor failed, shut down: %s", exc)
        return 1
    except BaseExceptionGroup as group:
        failed = group.subgroup(lambda e: isinstance(e, ActorFailed))
        if failed is None:
            raise
        while isinstance(failed, BaseExceptionGroup):
            failed = failed.exceptions[0]
        log.error("engine actor failed, shut down: %s", failed)
        return 1
    except KeyboardInterrupt:
        log.info("interrupted during start-up")
        return 130
    return 0


async def _serve(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    from trillium import __version__
    from trillium.data_plane import DataPlaneEngine, create_app, serve_app
    from trillium.models.loader import load_model_config
    from trillium.models.tokenizer import load_tokenizer

    ipc_dir = tempfile.mkdtemp(prefix="trillium-ipc-")
    config = ActorConfig(engine_config, Addresses.ipc(ipc_dir))
    tokenizer = await trio.to_thread.run_sync(load_tokenizer, engine_config.model)
    vocab_size = load_model_config(engine_config.model).vocab_size
    client = EngineClient(config)
    supervision = Supervision(alive={})
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            log.info("starting engine actors (executor, detokenizer, scheduler) for %s", engine_config.model)
            supervision = await nursery.start(run_in_subprocesses, engine_specs(config))
            log.info("engine actors up: %s", ", ".join(f"{n} pid {p}" for n, p in supervision.pids.items()))
            engine = DataPlaneEngine(
                client=client,
                tokenizer=tokenizer,
                served_model_name=engine_config.served_model_name,
                max_model_len=engine_config.max_model_len,
                vocab_size=vocab_size,
                api_key=server_config.api_key,
                max_queued_requests=server_config.max_queued_requests,
                health=lambda: (supervision.healthy, dict(supervision.alive)),
                version=__version__,
            )
            app = create_app(engine)
            shutdown = trio.Event()
            nursery.start_soon(_watch_signals, shutdown)
            port = await nursery.start(
                functools.partial(
                    serve_app, app, server_config.host, server_config.port,
                    shutdown_trigger=shutdown.wait, graceful_timeout_s=server_config.shutdown_timeout_s,
                )
            )
            log.info(
                "serving %s on http://%s:%d  (KV cache: %d tokens = %d blocks x %d; max_model_len %d)",
                engine_config.served_model_name, server_config.host, port,
                engine_config.num_kv_tokens, engine_config.num_blocks, engine_config.block_size,
                engine_config.max_model_len,
            )
            await shutdown.wait()
            log.info(
                "shutdown requested: no new connections; in-flight requests get up to %.0f s",
                server_config.shutdown_timeout_s,
            )
            # serve_app returns once in-flight requests finished (or the grace period ran out).
            await _wait_drained(client, server_config.shutdown_timeout_s + 1)
            nursery.cancel_scope.cancel()
    finally:
        client.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)
        log.info("stopped; engine processes are gone")


async def _watch_signals(shutdown: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s", signal.Signals(signum).name)
            shutdown.set()
            return


async def _wait_drained(client: EngineClient, timeout_s: float) -> None:
    with trio.move_on_after(timeout_s) as scope:
        while client.num_active_requests:
            await trio.sleep(0.05)
    if scope.cancelled_caught:
        log.warning("grace period over: stopping with %d requests unfinished", client.num_active_requests)
