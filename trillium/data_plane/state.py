"""What every route of one app shares: the engine bundle and the app's own services.

Built once by `create_app` and handed to each route module's `blueprint()`
(no module globals, no `current_app` lookups). Owns the tokenizer runner,
the request limits, the in-flight registry (admission control) and the metrics registry.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence

import trio

from trillium.actors.protocol.vocabulary import EngineState
from trillium.data_plane.context import DataPlaneEngine
from trillium.data_plane.errors import bad_request, engine_not_ready, model_not_found, unavailable
from trillium.data_plane.generation import RETRY_AFTER_S, Generation, InflightRequests
from trillium.data_plane.limits import num_engine_requests
from trillium.data_plane.metrics import DataPlaneMetrics
from trillium.data_plane.tokenization import TokenizerRunner
from trillium.sampling_params import SamplingParams

log = logging.getLogger(__name__)

WEIGHT_VERSION_HEADER = "X-Weight-Version"


class AppState:
    def __init__(self, engine: DataPlaneEngine, app) -> None:
        self.engine = engine
        self._app = app
        self.created_s = int(time.time())
        self.limits = engine.limits.for_model(engine.max_model_len)
        self.tokenizer = TokenizerRunner(engine.tokenizer, chat_template=engine.chat.chat_template, limits=self.limits)
        self.inflight = InflightRequests(engine.max_queued_requests)
        self.metrics = DataPlaneMetrics(engine.model_name, engine.client, self.inflight.count,
                                        engine.metrics_registry)

    @property
    def nursery(self) -> trio.Nursery:
        """The app's lifespan nursery (QuartTrio opens it at startup): streams' pumps run here."""
        return self._app.nursery

    def resolve_model(self, name: str | None) -> str:
        """The served name a request asked for (the default when absent); 404 otherwise."""
        if name is None:
            return self.engine.model_name
        self.lora_id(name)
        return name

    def lora_id(self, name: str | None) -> int:
        """The engine id of the LoRA adapter served as `name`, 0 for a base model name;
        404 for anything else (an adapter unloaded since `resolve_model` included)."""
        if name is None or name in self.engine.served_model_name:
            return 0
        loras = self.engine.loras
        module = None if loras is None else loras.get(name)
        if module is None:
            raise model_not_found(name)
        return module.lora_id

    def admit(self, params: Sequence[SamplingParams], prefix: str = "", *, pooling: bool = False) -> Generation:
        """A new Generation for one prompt per `params`, counted as in flight; 400 when
        a params passes a cap (limits.py; `prefix`: the wire's path to its fields), 503
        when the engine is unhealthy, not serving (sleeping, paused, updating weights)
        or its engine requests (prompts x n) would pass --max-queued-requests.

        The generation reports the weight version current at admission. Call
        right before `Generation.submit`, with no await in between, so the
        bound is exact and no weight update can start in between. `pooling`: the
        request is a pooling one (routes/pooling.py); the two kinds are each
        refused (400) on the other kind of model."""
        if pooling != (self.engine.pooling is not None):
            raise wrong_runner(pooling)
        for prompt_params in params:
            self.limits.check_params(prompt_params, prefix)
        if not self.healthy()[0]:
            raise unavailable(RETRY_AFTER_S)
        engine_state, weight_version = self.engine.current_status()
        if engine_state != EngineState.SERVING:  # the one state in which requests are admitted
            raise engine_not_ready(engine_state, RETRY_AFTER_S)
        generation = Generation(self.engine.client, weight_version, num_engine_requests(params),
                                log_requests=self.engine.log_requests)
        self.inflight.admit(generation)
        return generation

    def weight_version(self) -> str:
        return self.engine.current_status()[1]

    def healthy(self) -> tuple[bool, object]:
        try:
            return self.engine.health()
        except Exception as exc:  # WHY: a failing probe means unhealthy, not a 500
            log.warning("health probe failed: %s", exc)
            return False, f"health probe failed: {exc}"


def wrong_runner(pooling: bool):
    """400 for a pooling request on a generative model, or a generation request on a pooling one."""
    if pooling:
        return bad_request("this server runs a generative model: embeddings, scores and classification need a "
                           "pooling model (--runner pooling)", "model")
    return bad_request("this server runs a pooling model (--runner pooling): use /v1/embeddings, /classify, "
                       "/score, /rerank or /pooling", "model")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
