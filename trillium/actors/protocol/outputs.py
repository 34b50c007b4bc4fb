"""scheduler -> detokenizer -> api: token deltas, text deltas, stats.

Pattern: scheduler PUSH -> detokenizer PULL (detokenizer binds);
detokenizer PUSH -> api PULL (api binds); scheduler PUSH -> api PULL for
stats (the same api inbox).
"""

from __future__ import annotations

import attrs
import numpy as np

from trillium.actors.protocol.execute import PromptLogprobs, TokenLogprobs


@attrs.frozen
class DetokenizeSpec:
    """What the detokenizer needs to know of a request; sent with its first delta."""

    prompt_token_ids: np.ndarray  # int32
    skip_special_tokens: bool
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    min_tokens: int = 0


@attrs.frozen
class RequestDelta:
    """New tokens of one request this step. finish_reason: None while running,
    else "stop" (EOS / stop token), "length", "abort"."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: PromptLogprobs | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    spec: DetokenizeSpec | None = None


@attrs.frozen
class TokenDeltas:
    """All request deltas of one engine step."""

    step_id: int
    deltas: tuple[RequestDelta, ...]


@attrs.frozen
class RequestOutputDelta:
    """Text and tokens to hand to the client for one request."""

    request_id: str
    text: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: PromptLogprobs | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@attrs.frozen
class RequestOutputs:
    deltas: tuple[RequestOutputDelta, ...]


@attrs.frozen
class SchedulerStats:
    """Per-step engine state for metrics (scheduler -> api)."""

    step_id: int
    num_running: int
    num_waiting: int
    num_preempted_total: int
    kv_usage: float
    num_free_blocks: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    num_scheduled_tokens: int
    engine_state: str = "serving"  # scheduler/lifecycle.py EngineState value
    weight_version: str = "0"


MESSAGES = (
    DetokenizeSpec,
    RequestDelta,
    TokenDeltas,
    RequestOutputDelta,
    RequestOutputs,
    SchedulerStats,
)
