"""scheduler -> detokenizer -> api: token deltas, text deltas, stats.

Pattern: scheduler PUSH -> detokenizer PULL (detokenizer binds);
detokenizer PUSH -> api PULL (api binds); scheduler PUSH -> api PULL for
stats (the same api inbox).
"""

from __future__ import annotations

import attrs
import numpy as np

from trillium.actors.protocol.execute import PromptLogprobs, TokenLogprobs
from trillium.actors.protocol.vocabulary import EngineState


@attrs.frozen
class DetokenizeSpec:
    """What the detokenizer needs to know of a request; sent with its first delta.

    For the n > 1 choices of one request (one group) it is sent once, with
    the first delta of the group that goes out (scheduler/group_specs.py);
    the other choices' first deltas carry only `RequestDelta.group_id`, and
    the detokenizer keeps the spec until `num_choices` choices took it."""

    prompt_token_ids: np.ndarray  # int32
    skip_special_tokens: bool
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    min_tokens: int = 0
    spaces_between_special_tokens: bool = True
    trace_context: dict[str, str] | None = None  # the AddRequest's W3C carrier (detokenize span)
    num_choices: int = 1  # choices of the request that share this spec (its group's size)


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
    queue_time_s: float | None = None  # with the first delta: scheduler arrival -> first scheduled
    group_id: str | None = None  # with the first delta of a choice of an n > 1 request (see DetokenizeSpec)
    pooled: np.ndarray | None = None  # pooling models: the request's float32 output (BatchResult.pooled)


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
    queue_time_s: float | None = None  # with the first delta (see RequestDelta)
    pooled: np.ndarray | None = None  # pooling models, with the finishing delta (see RequestDelta)


@attrs.frozen
class RequestOutputs:
    deltas: tuple[RequestOutputDelta, ...]


@attrs.frozen
class FinishedRequestStats:
    """Timings of one finished engine request (seconds; wall clock, one host).

    queue: scheduler received it -> first scheduled; prefill: first
    scheduled -> first token; decode: first -> last token; inference: first
    scheduled -> last token; e2e: api arrival -> finished. None where the
    request never got that far (aborted while waiting, say)."""

    finish_reason: str
    e2e_s: float
    queue_s: float
    prefill_s: float | None
    decode_s: float | None
    inference_s: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int = 0


@attrs.frozen
class KvTierStats:
    """One KV cache tier ("device", "host", "disk"): usage now and lifetime totals, in blocks."""

    tier: str
    usage: float  # fraction of the tier's blocks in use (device: held by requests)
    num_blocks: int
    hit_blocks_total: int  # prefix-cache hits served from this tier
    evicted_blocks_total: int  # cached blocks this tier dropped to make room


@attrs.frozen
class SchedulerStats:
    """Engine state and what happened since the last SchedulerStats (scheduler -> api).

    Gauges and lifetime totals (num_running ... prefix_cache_hits_total) are
    the state now. The rest are events since the previous SchedulerStats,
    which the api folds into its counters and histograms: each stats
    message is sent exactly once, over a reliable PUSH socket, so no event
    is counted twice or lost.
    """

    step_id: int
    num_running: int
    num_waiting: int
    num_preempted_total: int
    kv_usage: float
    num_free_blocks: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    num_scheduled_tokens: int
    engine_state: EngineState = EngineState.SERVING
    weight_version: str = "0"
    # Swap preemption totals (0 under recompute): preemptions whose KV went to
    # the host tier (the rest of num_preempted_total recompute), and re-admissions
    # that loaded it back.
    num_swapped_out_total: int = 0
    num_swapped_in_total: int = 0
    # -- events since the previous SchedulerStats --
    finished: tuple[FinishedRequestStats, ...] = ()
    ttfts_s: tuple[float, ...] = ()  # api arrival -> first token, per request that got one
    itls_s: tuple[float, ...] = ()  # between consecutive tokens of a request
    num_prompt_tokens: int = 0  # prompts of requests that got their first token
    num_generation_tokens: int = 0
    step_tokens: tuple[int, ...] = ()  # tokens scheduled per step
    step_durations_s: tuple[float, ...] = ()  # executor time per step
    mailbox_depth: int = 0  # messages the scheduler found waiting at its last drain
    num_lora_swap_ins: int = 0  # adapters the executor loaded into device slots
    # -- LoRA state now --
    running_lora_ids: tuple[int, ...] = ()
    waiting_lora_ids: tuple[int, ...] = ()
    max_loras: int = 0
    # -- KV tiers (only with a host tier: empty / 0 otherwise) --
    kv_tiers: tuple[KvTierStats, ...] = ()  # fastest first
    kv_bytes_to_host_total: int = 0
    kv_bytes_to_device_total: int = 0
    kv_bytes_to_disk_total: int = 0  # host evictions written to the disk tier
    kv_bytes_from_disk_total: int = 0  # disk blocks read back into host memory
    kv_disk_failed_reads_total: int = 0  # corrupt / truncated / foreign block files (recomputed)
    kv_load_s: tuple[tuple[str, float], ...] = ()  # events: (tier, seconds) per load (host: a step's copies; disk: a request's wait)
    # -- speculative decoding (lifetime totals; 0 / () when off): trillium/speculative/scheduling.py --
    spec_decode_num_drafts_total: int = 0  # verifications with at least one draft
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_num_accepted_tokens_per_pos_total: tuple[int, ...] = ()  # [k]: drafts accepted at position i
    spec_decode_num_steps_disabled_by_batch_size_total: int = 0  # steps planned without drafts (Trillium's)

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """vLLM's mean acceptance length: 1 + accepted / drafts (the bonus token counts); 1.0 with no drafts."""
        if not self.spec_decode_num_drafts_total:
            return 1.0
        return 1.0 + self.spec_decode_num_accepted_tokens_total / self.spec_decode_num_drafts_total


MESSAGES = (
    DetokenizeSpec,
    RequestDelta,
    TokenDeltas,
    RequestOutputDelta,
    RequestOutputs,
    FinishedRequestStats,
    KvTierStats,
    SchedulerStats,
)
