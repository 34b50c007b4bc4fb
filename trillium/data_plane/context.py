"""What the data plane's routes need from the rest of the server, in one bundle.

`DataPlaneEngine` is built once by whoever serves the app (`trillium serve`,
tests) and handed to `create_app`. It holds no state of its own: the engine
client routes requests, the tokenizer encodes them, the rest is
configuration and a health probe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from trillium import __version__
from trillium.actors.protocol.vocabulary import EngineState
from trillium.data_plane.chat_options import ChatOptions
from trillium.data_plane.limits import RequestLimits

if TYPE_CHECKING:
    from trillium.actors.client import EngineClient
    from trillium.models.tokenizer import Tokenizer
    from trillium.observability.tracing import RequestTracing

HealthProbe = Callable[[], tuple[bool, Any]]
# () -> (engine_state, weight_version); see DataPlaneEngine.engine_status.
EngineStatusProbe = Callable[[], tuple[EngineState, str]]


def _always_healthy() -> tuple[bool, Any]:
    return True, "ok"


def _names(value: str | Sequence[str]) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"served_model_name: need at least one non-empty name, got {value!r}")
    return names


@attrs.frozen
class DataPlaneEngine:
    """Everything the data plane routes use.

    client: a running `EngineClient` (its `run()` task is owned by the caller).
    tokenizer: `trillium.models.tokenizer.Tokenizer` of the served model.
    served_model_name: the name(s) clients may pass as `model`; the first is
        the one `/v1/models` lists first and responses report by default.
    max_model_len: context length in tokens (prompt + generated).
    vocab_size: the model's vocabulary size (token ids are checked against it).
    health: `() -> (ok, detail)`; `/health` answers 200 when ok, else 503.
    api_key: when set, `/v1/*` requires `Authorization: Bearer <api_key>` (or `x-api-key: <api_key>`).
    max_queued_requests: most engine requests (prompts x n of every HTTP
        request) in the engine and not finished; an HTTP request that would
        pass it gets 503 + Retry-After. None: unbounded (`trillium serve`
        derives a default: limits.default_max_queued_requests).
    limits: the per-request caps, body size and connection cap (limits.py).
    version: reported by `/version`.
    eos_token_ids: None means the tokenizer's.
    engine_status: `() -> (engine_state, weight_version)`. Requests are
        admitted only while the state is "serving" (else 503 + Retry-After);
        the version is reported in every response. None: read both from
        the client's latest SchedulerStats. `trillium serve` passes the
        control plane's view, which also knows about commands in flight.
    metrics_registry: the process's prometheus CollectorRegistry, holding
        the engine series (`trillium serve` shares one between both planes);
        None: the app builds its own, fed from `client`.
    tracing: the api process's `observability.tracing.RequestTracing`
        (shared with the admin app's /tracing route); None: no tracing.
    chat: the chat template and parsers of the chat route (chat_options.py).
    responses_store_size: how many /v1/responses responses the app keeps for GET and
        previous_response_id (responses_store.py; --responses-store-size, 0: none).
    pooling: a pooling model's task, labels and sizes (trillium/pooling/outputs.py
        `PoolingModel.build`); None: a generative model. Pooling routes answer 400
        on a generative model and generation routes 400 on a pooling one.
    """

    client: "EngineClient"
    tokenizer: "Tokenizer"
    served_model_name: tuple[str, ...] = attrs.field(converter=_names)
    max_model_len: int
    vocab_size: int
    health: HealthProbe = _always_healthy
    api_key: str | None = None
    max_queued_requests: int | None = None
    limits: RequestLimits = RequestLimits()
    version: str = __version__
    eos_token_ids: tuple[int, ...] | None = None
    engine_status: EngineStatusProbe | None = None
    metrics_registry: Any = None
    tracing: "RequestTracing | None" = None
    loras: Any = None  # trillium.lora.registry.LoRARegistry shared with the control plane; None: LoRA off
    # vLLM compatibility (cli_compat.py): the generation_config.json defaults
    # (generation_defaults.SamplingDefaults; None: none), the largest logprobs a request
    # may ask for, the chat reply's role, and --enable-log-requests.
    sampling_defaults: Any = None
    max_logprobs: int = 20
    response_role: str = "assistant"
    log_requests: bool = False
    responses_store_size: int = 1000  # responses_store.DEFAULT_RESPONSES_STORE_SIZE

    @property
    def defaults(self):
        from trillium.generation_defaults import NO_DEFAULTS

        return self.sampling_defaults or NO_DEFAULTS
    chat: ChatOptions = ChatOptions()  # --chat-template, tool-call and reasoning parsers
    pooling: Any = None  # trillium.pooling.outputs.PoolingModel (--runner pooling); None: generative

    @property
    def model_name(self) -> str:
        return self.served_model_name[0]

    def current_status(self) -> tuple[EngineState, str]:
        """(engine_state, weight_version) right now."""
        if self.engine_status is not None:
            return self.engine_status()
        stats = self.client.last_stats
        if stats is None:
            return EngineState.SERVING, "0"
        return stats.engine_state, stats.weight_version

    @property
    def resolved_eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_ids is not None:
            return tuple(self.eos_token_ids)
        return tuple(self.tokenizer.eos_token_ids)
