"""`trillium serve`: the supervisor of DESIGN.md §2.

Process layout (one host):

    trillium serve (this process, "api")   HTTP data plane (--port), admin control
                                            plane (--admin-port), tokenizer, EngineClient
      ├─ executor     child process         weights, KV cache, forward + sampling
      ├─ detokenizer  child process         incremental detokenization, stop strings
      └─ scheduler    child process         batching, KV block pool, prefix cache
    (--data-parallel-size N: N such engine replicas, each its own sockets and link
    secret, behind one ReplicaClient; trillium/data_parallel/processes.py draws it)

Actors talk over ipc:// sockets in a private (0700) temp dir
(actors/ipc_dir.py), and every frame carries an HMAC proof under a secret
made for this run and handed to each child on its stdin
(actors/link_auth.py). If any child dies,
the supervisor raises ActorFailed: /health turns 503, every other child is
stopped, every open stream ends with an error event (a non-streamed
request gets a 503 body) naming the actor, the HTTP servers finish those
responses, and the server exits 1 with the cause logged. A child that is
alive but stalled (no pong, or no step with work queued, for
--engine-stall-timeout-s: actors/liveness.py) turns /health 503 naming it
and fails the open streams the same way; the server keeps serving and
recovers when the actor answers again. SIGTERM / Ctrl-C stops accepting connections, lets in-flight
requests finish for `--shutdown-timeout` seconds, then stops every child.

The two HTTP planes share the EngineClient and one `EngineStatus` (the
control plane's view of the engine state and weight version, which the
data plane reads to refuse requests while the engine sleeps, is paused or
loads weights, and to stamp each response with its weight version), and
one `RequestTracing` (the admin route /tracing switches what the data plane
samples; each process exports its own spans). The admin token is resolved before anything loads: an unsafe setting (a
non-loopback admin host without a token) exits with code 2.

`--admin-on-data-port` also serves the admin routes on the data port, for
RL frameworks that send admin calls to the generation URL: the data port's
ASGI app routes the admin app's paths (those the data plane does not have
itself) to the same admin app, which the admin port serves as before. The
planes still never import each other; the mount is made here. With an admin
token those routes need it; without one the flag is allowed only on a
loopback --host (they are open there; a warning is logged), else exit 2.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import signal
import sys
import tempfile
from typing import TYPE_CHECKING

import attrs
import trio

from trillium.actors.client import EngineClient
from trillium.actors.assembly import ActorConfig, engine_specs
from trillium.actors.links import Links
from trillium.actors.liveness import ENGINE_ACTORS, StallDetector, watch_engine
from trillium.actors.protocol.vocabulary import EngineState
from trillium.actors.supervisor import ActorFailed, Supervision, run_in_subprocesses
from trillium.config import EngineConfig
from trillium.http_cors import CorsPolicy, with_cors
from trillium.pooling.outputs import PoolingModel

if TYPE_CHECKING:
    from trillium.data_plane.chat_options import ChatOptions
    from trillium.data_plane.limits import RequestLimits

log = logging.getLogger("trillium.serve")

# The engine's children never see these (a core dump or /proc/<pid>/environ of an actor leaks nothing).
SECRET_ENV_VARS = ("TRILLIUM_ADMIN_TOKEN", "TRILLIUM_API_KEY")
_HTTP_FINISH_S = 3.0  # after the drain: how long the HTTP servers get to finish their last responses


@attrs.frozen
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queued_requests: int | None = None  # engine requests; None: derived (data_plane/limits.py), 0: no limit
    limits: "RequestLimits | None" = None  # the data plane's caps; None: the defaults
    shutdown_timeout_s: float = 10.0
    admin_host: str = "127.0.0.1"
    admin_port: int = 8001
    admin_token: str | None = None  # None: generated and logged (loopback admin host only)
    allowed_weight_paths: tuple[str, ...] | None = None  # None: the directory of the model
    profile_dir: str | None = None  # None: <tmp>/trillium-profile-<pid>, created on first use
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) loaded at start
    allowed_lora_paths: tuple[str, ...] | None = None  # None: the directories of lora_modules
    admin_on_data_port: bool = False  # also mount the admin routes on the data port
    data_port_admin_open: bool = False  # resolved: those routes need no token (loopback, no token given)
    # vLLM-compatible flags (cli_compat.py): more names the model answers to, the chat reply
    # role, the logprobs cap, request logging, CORS (None: off), TLS on the data port.
    extra_model_names: tuple[str, ...] = ()
    response_role: str = "assistant"
    max_logprobs: int = 20
    log_requests: bool = False
    cors: "CorsPolicy | None" = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    chat: "ChatOptions | None" = None  # chat template and parsers; None: the defaults
    engine_stall_timeout_s: float = 60.0  # no pong / no step with work queued for this long: stalled (0: off)
    responses_store_size: int = 1000  # /v1/responses kept in memory (data_plane/responses_store.py)
    data_parallel_size: int = 1  # engine replicas behind this api (data_parallel/; README "Scaling out")
    # --link-secret-file (more than one host, cli_nodes.py): the deployment's secret, hex; None: a fresh one
    link_secret: str | None = attrs.field(default=None, repr=False)
    # Replicas on other hosts (data_parallel/remote.py): this host runs replicas 0..local-1, the join
    # socket listens at tcp://address:rpc_port; None: every replica here.
    data_parallel_size_local: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Resolve the config, run until a signal or an actor failure; exit code (2: unsafe admin settings)."""
    from trillium.control_plane.auth import (
        AdminConfigError, data_port_requires_token, resolve_admin_token, token_fingerprint)

    try:
        admin_token, generated = resolve_admin_token(
            server_config.admin_host, server_config.admin_token, server_config.api_key
        )
        open_mount = server_config.admin_on_data_port and not data_port_requires_token(
            server_config.host, token_given=not generated)
    except AdminConfigError as exc:
        log.error("%s", exc)
        return 2
    if generated:
        # WHY print, not log: log lines are shipped and kept; the token goes to the terminal once,
        # the log gets only its fingerprint (to tell which token a client holds).
        print(f"trillium: admin API token (generated for this run): {admin_token}", file=sys.stderr, flush=True)
        log.warning("admin API token generated (sha256 fingerprint %s; printed once on stderr; set "
                    "--admin-token-file or TRILLIUM_ADMIN_TOKEN to choose one)", token_fingerprint(admin_token))
    if open_mount:
        log.warning("--admin-on-data-port without an admin token: the admin routes (weights, sleep, pause, ...) "
                    "on http://%s:%d need no token; anyone who can reach that loopback port can use them",
                    server_config.host, server_config.port)
    server_config = attrs.evolve(server_config, admin_token=admin_token, data_port_admin_open=open_mount)
    try:
        engine_config = engine_config.resolve()
    except (ValueError, FileNotFoundError) as exc:  # an unsupported model, a context that does not fit, ...
        log.error("cannot serve %s: %s", engine_config.model, exc)
        return 2
    try:
        trio.run(_serve, engine_config, server_config)
    except ActorFailed as exc:
        log.error("engine actor failed, shut down: %s", exc)
        return 1
    except BaseExceptionGroup as group:
        failed = group.subgroup(lambda e: isinstance(e, ActorFailed))
        bad_lora = group.subgroup(lambda e: isinstance(e, LoRAStartupError))
        if bad_lora is not None:
            log.error("%s", _first(bad_lora))
            return 2
        if failed is None:
            unbound = group.subgroup(lambda e: isinstance(e, OSError) and e.errno == errno.EADDRINUSE)
            if unbound is None:
                raise
            log.error("cannot listen: %s (another server on --port %d or --admin-port %d?)",
                      _first(unbound), server_config.port, server_config.admin_port)
            return 1
        log.error("engine actor failed, shut down: %s", _first(failed))
        return 1
    except KeyboardInterrupt:
        log.info("interrupted during start-up")
        return 130
    return 0


async def _serve(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    from trillium import __version__
    from trillium.control_plane import EngineStatus, create_admin_app
    from trillium.data_plane import DataPlaneEngine, create_app
    from trillium.data_plane.limits import RequestLimits, default_max_queued_requests
    from trillium.models.loader import load_model_config
    from trillium.observability.tracing import RequestTracing
    from prometheus_client import CollectorRegistry

    from trillium.lora.registry import LoRARegistry

    from trillium.actors.ipc_dir import make_ipc_dir

    ipc_dir = make_ipc_dir()  # 0700, owner recorded; dead servers' ones swept first
    from trillium.generation_defaults import load_sampling_defaults

    defaults = load_sampling_defaults(engine_config.model, engine_config.generation_config,
                                      engine_config.override_generation_config)
    log.info("%s", defaults.describe())
    vocab_size = load_model_config(engine_config.model).vocab_size
    loras = LoRARegistry() if engine_config.enable_lora else None
    registry = CollectorRegistry()
    shutdown = trio.Event()
    from trillium.data_parallel.remote import join_remote_replicas

    join = await join_remote_replicas(engine_config, server_config)  # None: every replica on this host
    client, processes = _build_engine(engine_config, server_config, ipc_dir, registry, loras, shutdown, join)
    status = EngineStatus(lambda: client.last_stats)
    tracing = RequestTracing.from_config(engine_config, "api")
    if tracing.enabled:
        log.info("tracing: OTLP/HTTP spans to %s%s", engine_config.otlp_traces_endpoint,
                 " (detailed)" if tracing.detailed else "")
    health = processes.health

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            if join is not None:
                nursery.start_soon(join.count_strangers)
            log.info("starting engine actors (executor, detokenizer, scheduler)%s for %s",
                     f" x {server_config.data_parallel_size} replicas" if server_config.data_parallel_size > 1
                     else "", engine_config.model)
            # WHY beside the actors' start: loading the tokenizer is seconds of this process's
            # time that the children's imports need not wait for. The detokenizers wait for its
            # backend instead of loading their own (detokenizer/backend_handoff.py).
            tokenizer_box: list = []
            async with trio.open_nursery() as starting:
                starting.start_soon(_load_into, tokenizer_box, _load_tokenizer, engine_config.tokenizer_path,
                                    _backend_file(ipc_dir))
                supervision = processes.supervision = await nursery.start(processes.supervise)
            tokenizer = tokenizer_box[0]
            log.info("engine actors up: %s (sockets in %s)",
                     ", ".join(f"{n} pid {pid}" for n, pid in supervision.pids.items()), ipc_dir)
            processes.watch(nursery, steppable=lambda: status.engine_state in (EngineState.SERVING,
                                                                               EngineState.DRAINING))
            if server_config.lora_modules:
                await _load_lora_modules(client, loras, server_config.lora_modules)
            limits = server_config.limits or RequestLimits()
            max_queued = server_config.max_queued_requests
            if max_queued is None:
                replicas = server_config.data_parallel_size  # WHY: each replica holds its own queue
                max_queued = replicas * default_max_queued_requests(engine_config.max_num_seqs,
                                                                    engine_config.num_blocks)
                log.info("--max-queued-requests %d engine requests (from max_num_seqs %d and %d KV blocks%s)",
                         max_queued, engine_config.max_num_seqs, engine_config.num_blocks,
                         f", x {replicas} replicas" if replicas > 1 else "")
            engine = DataPlaneEngine(
                client=client,
                tokenizer=tokenizer,
                served_model_name=(engine_config.served_model_name, *server_config.extra_model_names),
                max_model_len=engine_config.max_model_len,
                vocab_size=vocab_size,
                api_key=server_config.api_key,
                max_queued_requests=max_queued or None,
                limits=limits,
                health=health,
                version=__version__,
                engine_status=status.snapshot,
                metrics_registry=registry,
                tracing=tracing,
                loras=loras,
                sampling_defaults=defaults,
                max_logprobs=server_config.max_logprobs,
                response_role=server_config.response_role,
                log_requests=server_config.log_requests,
                responses_store_size=server_config.responses_store_size,
                pooling=PoolingModel.build(engine_config),
                **({"chat": server_config.chat} if server_config.chat is not None else {}),
            )
            app = create_app(engine)
            admin = _admin_engine(
                client, engine_config, server_config, status, lambda: dict(processes.supervision.pids),
                health, registry, tracing, loras,
            )
            admin_app = create_admin_app(admin)
            nursery.start_soon(_watch_signals, shutdown)
            async with trio.open_nursery() as http:
                await _serve_http(http, app, admin_app, admin, engine_config, server_config, shutdown)
                await shutdown.wait()
                log.info(
                    "shutdown requested: no new connections; in-flight requests get up to %.0f s",
                    server_config.shutdown_timeout_s,
                )
                await _wait_drained(client, server_config.shutdown_timeout_s + 1)
                # The servers return once their responses are written (error events included); bounded.
                http.cancel_scope.deadline = trio.current_time() + _HTTP_FINISH_S
            nursery.cancel_scope.cancel()
    finally:
        client.close()
        if join is not None:
            join.close()
        tracing.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)
        log.info("stopped; engine processes are gone")
    if processes.failure is not None:
        raise processes.failure


def _build_engine(engine_config, server_config, ipc_dir, registry, loras, shutdown, join=None):
    """The client the HTTP planes use and the supervised processes behind it, engine series registered:
    one engine, or --data-parallel-size replicas (data_parallel/: a ReplicaClient and ReplicaProcesses,
    each replica's series labelled engine="<i>")."""
    from prometheus_client import CollectorRegistry
    from trillium.data_parallel.processes import ReplicaProcesses, replica_configs
    from trillium.observability.metrics import EngineMetrics

    num_replicas, stall_s = server_config.data_parallel_size, server_config.engine_stall_timeout_s
    num_local = num_replicas if join is None else server_config.data_parallel_size_local
    configs = [attrs.evolve(config, tokenizer_backend_file=_backend_file(ipc_dir))
               for config in replica_configs(engine_config, ipc_dir, num_local)]
    if server_config.link_secret is not None and join is None:  # every host's ranks prove the one they share
        configs = [attrs.evolve(config, link_secret=server_config.link_secret) for config in configs]
    if join is not None:  # replicas on other hosts: tcp:// links, each its own derived secret
        from trillium.data_parallel.remote import replica_secret

        configs += [ActorConfig(engine_config, join.joined[i]["addresses"],
                                link_secret=replica_secret(server_config.link_secret, i))
                    for i in range(num_local, num_replicas)]
    clients = [EngineClient(config) for config in configs]
    if num_replicas == 1:
        client = clients[0]
        processes = _EngineProcesses(configs[0], client, stall_s, shutdown)
        fed = [(registry, client, processes)]
    else:
        from trillium.data_parallel.client import ReplicaClient
        from trillium.data_parallel.metrics import ReplicaSeries
        from trillium.data_parallel.router import ReplicaRouter

        client = ReplicaClient(clients, ReplicaRouter(num_replicas, engine_config.block_size,
                                                      engine_config.num_kv_tokens))
        processes = ReplicaProcesses([], client, shutdown)
        from trillium.data_parallel.remote import replica_processes

        processes.replicas = [
            replica_processes(index, config, replica, stall_s, shutdown, processes, client, join)
            for index, (config, replica) in enumerate(zip(configs, clients))]
        registries = [CollectorRegistry() for _ in clients]
        registry.register(ReplicaSeries(registries))
        if join is not None:  # strangers at the join socket (data_parallel/remote.py), actor="dp-join"
            from trillium.data_parallel.remote import JOIN_ACTOR
            from trillium.observability.link_metrics import RejectedFramesCollector

            registry.register(RejectedFramesCollector(engine_config.served_model_name, join.rejected_frames,
                                                      actors=(JOIN_ACTOR,)))
        fed = list(zip(registries, clients, processes.replicas))
    for replica_registry, replica, replica_procs in fed:
        metrics = EngineMetrics(replica_registry, engine_config.served_model_name,
                                lambda replica=replica: replica.last_stats,
                                api_mailbox_depth=lambda replica=replica: replica.mailbox_depth,
                                actors_alive=lambda p=replica_procs: dict(p.supervision.alive), loras=loras)
        metrics.attach(replica)
        metrics.watch_liveness(replica_procs.detector)
    return client, processes


async def _serve_http(http, app, admin_app, admin, engine_config, server_config, shutdown) -> None:
    """Start both HTTP servers in `http` (they stop when `shutdown` is set) and log where."""
    from trillium.control_plane import serve_admin_app
    from trillium.data_plane import serve_app

    serve_admin = functools.partial(
        serve_admin_app, admin_app, server_config.admin_host, server_config.admin_port,
        shutdown_trigger=shutdown.wait, graceful_timeout_s=server_config.shutdown_timeout_s,
    )
    data_app = app
    if server_config.cors is not None:
        data_app = with_cors(data_app, server_config.cors)
    if server_config.admin_on_data_port:
        # WHY the admin port first: it runs the admin app's lifespan, which the mount relies on.
        admin_port = await http.start(serve_admin)
        data_app = _with_admin_routes(data_app, admin_app, server_config)
    port = await http.start(
        functools.partial(
            serve_app, data_app, server_config.host, server_config.port,
            shutdown_trigger=shutdown.wait, graceful_timeout_s=server_config.shutdown_timeout_s,
            certfile=server_config.ssl_certfile, keyfile=server_config.ssl_keyfile,
        )
    )
    if not server_config.admin_on_data_port:
        admin_port = await http.start(serve_admin)
    log.info(
        "admin API on http://%s:%d (Bearer token required; weight paths allowed under %s; "
        "profiles to %s)", server_config.admin_host, admin_port,
        ", ".join(admin.weight_paths.roots) or "nowhere", admin.profile_dir,
    )
    log.info(
        "serving %s on %s://%s:%d  (KV cache: %d tokens = %d blocks x %d; max_model_len %d)",
        ", ".join((engine_config.served_model_name, *server_config.extra_model_names)),
        "https" if server_config.ssl_certfile else "http", server_config.host, port,
        engine_config.num_kv_tokens, engine_config.num_blocks, engine_config.block_size,
        engine_config.max_model_len,
    )


class _EngineProcesses:
    """The engine's child processes as the api sees them: supervised, watched for stalls, /health.

    An actor that dies after start-up does not cancel the server at once: the
    open streams first end with an error (`EngineClient.fail_all`), `shutdown`
    is set so the HTTP servers finish those responses, and `failure` is
    re-raised once everything stopped (exit code 1)."""

    def __init__(self, config: ActorConfig, client: EngineClient, stall_timeout_s: float,
                 shutdown: trio.Event, on_failure=None, fail_streams=None) -> None:
        self._config = config
        self._client = client
        self._shutdown = shutdown
        # Data parallelism (data_parallel/processes.py): what one replica's failure does, and how its
        # streams are failed on a stall (through the ReplicaClient, which tracks every request's replica).
        self._on_failure = on_failure
        self._fail_streams = fail_streams or client.fail_all
        self.supervision = Supervision(alive={})
        self.detector = StallDetector(ENGINE_ACTORS, stall_timeout_s)
        self.failure: ActorFailed | None = None

    def health(self) -> tuple[bool, object]:
        if not self.supervision.healthy:
            return False, dict(self.supervision.alive)
        if self.detector.stall is not None:
            return False, str(self.detector.stall)
        return True, dict(self.supervision.alive)

    async def supervise(self, *, task_status) -> None:
        started = _Started(task_status)
        try:
            await run_in_subprocesses(engine_specs(self._config), task_status=started, drop_env=SECRET_ENV_VARS)
        except ActorFailed as exc:
            if not started.done:
                raise
            # WHY not re-raise here: that would cancel the HTTP servers mid-response.
            self.failure = exc
            log.error("engine actor failed: %s", exc)
            if self._on_failure is not None:
                self._on_failure(exc)
                return
            self._client.fail_all(f"engine actor {exc.name!r} failed", commands=True)
            self._shutdown.set()

    def watch(self, nursery: trio.Nursery, steppable) -> None:
        """Start the stall watchdog (actors/liveness.py) unless its timeout is 0."""
        timeout_s = self.detector.stall_timeout_s
        if timeout_s <= 0:
            return
        links = Links(self._config, "api")  # WHY: pings carry the link proof like every engine frame
        nursery.start_soon(functools.partial(
            watch_engine, self._client, self.detector, links.outbox,
            ping_interval_s=min(1.0, timeout_s / 4), steppable=steppable,
            on_stall=lambda stall: self._fail_streams(str(stall)),
            active=lambda: self.supervision.healthy and self.failure is None,
        ))


async def _load_into(box: list, load, *args) -> None:
    box.append(await trio.to_thread.run_sync(load, *args))


def _backend_file(ipc_dir: str) -> str:
    from trillium.actors.detokenizer.backend_handoff import BACKEND_FILE

    return os.path.join(ipc_dir, BACKEND_FILE)


def _load_tokenizer(tokenizer_path: str, backend_file: str):
    """The api's tokenizer, its backend published for every replica's detokenizer (one file)."""
    from trillium.actors.detokenizer.backend_handoff import publish_backend
    from trillium.models.tokenizer import load_tokenizer  # WHY here: transformers' import, off the loop

    tokenizer = load_tokenizer(tokenizer_path)
    publish_backend(tokenizer, backend_file)
    return tokenizer


class _Started:
    """A task_status that remembers whether started() was called."""

    def __init__(self, task_status) -> None:
        self._task_status = task_status
        self.done = False

    def started(self, value=None) -> None:
        self.done = True
        self._task_status.started(value)


def _with_admin_routes(app, admin_app, server_config: ServerConfig):
    """The data port's ASGI app under --admin-on-data-port: the admin app's own paths go to it."""
    from trillium.control_plane import data_port_mount
    from trillium.http_serving import by_path, exclusive_paths

    paths = exclusive_paths(admin_app, app)
    log.info("admin routes also on the data port (%s): %d paths", "no token" if server_config.data_port_admin_open
             else "Bearer admin token required", len(paths))
    return by_path(app, data_port_mount(admin_app, require_token=not server_config.data_port_admin_open), paths)


def _first(group: BaseException) -> BaseException:
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group


def _profile_dir(server_config: ServerConfig) -> str:
    return server_config.profile_dir or os.path.join(tempfile.gettempdir(), f"trillium-profile-{os.getpid()}")


def _admin_engine(client, engine_config, server_config, status, actor_pids, health, registry, tracing, loras):
    """The control plane's bundle: the same client and status object as the data plane."""
    from trillium import __version__
    from trillium.control_plane import ControlPlaneEngine
    from trillium.control_plane.paths import WeightPathPolicy, default_roots

    roots = server_config.allowed_weight_paths
    if roots is None:
        roots = default_roots(engine_config.model)
    return ControlPlaneEngine(
        client=client, engine_config=engine_config, admin_token=server_config.admin_token,
        weight_paths=WeightPathPolicy(roots), profile_dir=_profile_dir(server_config), status=status,
        actor_pids=actor_pids, health=health, version=__version__, metrics_registry=registry,
        tracing=tracing, loras=loras, lora_paths=WeightPathPolicy(_lora_roots(server_config)),
    )


def _lora_roots(server_config: ServerConfig) -> tuple[str, ...]:
    if server_config.allowed_lora_paths is not None:
        return server_config.allowed_lora_paths
    return tuple(os.path.dirname(os.path.realpath(path)) for _, path in server_config.lora_modules)


class LoRAStartupError(Exception):
    pass


async def _load_lora_modules(client, loras, modules) -> None:
    """--lora-modules: load each adapter before serving; a bad one stops the start (exit code 2)."""
    from trillium.actors.protocol.admin import LoadLoRAAdapter

    for name, path in modules:
        path = os.path.realpath(path)
        try:
            module = loras.reserve(name, path)
        except KeyError:
            raise LoRAStartupError(f"--lora-modules: the name {name!r} is given twice") from None
        reply = await client.control(LoadLoRAAdapter(f"lora-module-{module.lora_id}", module.lora_id, name, path))
        if not reply.ok:
            raise LoRAStartupError(f"--lora-modules {name}={path}: {reply.message}")
        loras.added(name)
        log.info("LoRA adapter %r loaded from %s", name, path)


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
