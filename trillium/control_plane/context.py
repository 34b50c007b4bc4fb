"""What the admin routes need from the rest of the server, in one bundle.

`ControlPlaneEngine` is built once by whoever serves the admin app
(`trillium serve`, tests) and handed to `create_admin_app`. The engine
client carries the commands; `status` is the api-side view of the engine's
state and weight version, shared with the data plane's admission check;
the rest is configuration and probes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from trillium import __version__
from trillium.control_plane.paths import WeightPathPolicy
from trillium.control_plane.status import EngineStatus

if TYPE_CHECKING:
    from trillium.actors.client import EngineClient
    from trillium.config import EngineConfig
    from trillium.observability.tracing import RequestTracing

HealthProbe = Callable[[], tuple[bool, Any]]

DEFAULT_MAX_BODY_BYTES = 64 * 2**30  # a safetensors upload of a large model; the admin is trusted


def _always_healthy() -> tuple[bool, Any]:
    return True, "ok"


def _no_pids() -> dict[str, int]:
    return {}


def _status_of(self: "ControlPlaneEngine") -> EngineStatus:
    return EngineStatus(lambda: self.client.last_stats)


@attrs.frozen
class ControlPlaneEngine:
    """Everything the admin routes use.

    client: a running `EngineClient` (its `run()` task is owned by the caller).
    engine_config: the resolved `EngineConfig` (reported by /server_info).
    admin_token: every route requires `Authorization: Bearer <admin_token>`.
    weight_paths: where `update_weights_from_disk` may read (403 elsewhere).
    profile_dir: where the engine's actors write torch.profiler traces.
    status: the engine state / weight version view; pass the same object's
        `snapshot` to the data plane so both planes agree.
    actor_pids: `() -> {actor name: pid}` (the supervisor's Supervision).
    health: `() -> (ok, detail)`; `/health` answers 200 when ok, else 503.
    drain_timeout_s: how long a weight update sent while serving waits for
        requests in flight to finish (admission is closed meanwhile); the
        ones still running then are aborted, so none samples from two
        weight versions.
    command_timeout_s: longest wait for the engine's reply to a command.
    max_body_bytes: largest accepted request body (safetensors uploads).
    metrics_registry: the process's prometheus CollectorRegistry shared with
        the data plane (it holds the engine series); None: one of its own.
    tracing: the api process's `observability.tracing.RequestTracing`, the
        same object the data plane samples with (GET / POST /tracing);
        None: tracing cannot be enabled.
    """

    client: "EngineClient"
    engine_config: "EngineConfig"
    admin_token: str = attrs.field(validator=attrs.validators.min_len(1))
    weight_paths: WeightPathPolicy = WeightPathPolicy()
    profile_dir: str = ""
    status: EngineStatus = attrs.field(default=attrs.Factory(_status_of, takes_self=True))
    actor_pids: Callable[[], dict[str, int]] = _no_pids
    health: HealthProbe = _always_healthy
    version: str = __version__
    drain_timeout_s: float = 30.0
    command_timeout_s: float = 600.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    metrics_registry: Any = None
    loras: Any = None  # trillium.lora.registry.LoRARegistry (shared with the data plane); None: LoRA off
    lora_paths: WeightPathPolicy = WeightPathPolicy()  # where /v1/load_lora_adapter may read
    tracing: "RequestTracing | None" = None
