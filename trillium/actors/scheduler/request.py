"""The scheduler's view of one request: tokens, progress, status, stop rules.

A `Request` is built from an `AddRequest` and lives in the scheduler core
until it finishes. Its status is an explicit state machine
(`RequestStatus`, `TRANSITIONS`); every change goes through `set_status`,
which refuses a transition the table does not list.

    WAITING ──admit──> RUNNING ──preempt──> PREEMPTED ──admit──> RUNNING
       │                  │                     │
       └── abort/finish ──┴── EOS/stop/length ──┴──> FINISHED_*   (terminal)

    WAITING / PREEMPTED ──disk hit──> LOADING ──reads done──> back (queued again)

LOADING: the request's prefix is being read from the disk KV tier into host
memory (kv_tiers/disk.py); it is out of the queue and holds no device block.
The KV tier manager (kv_tiers/manager.py) keeps its loading bookkeeping.
"""

from __future__ import annotations

import enum

import attrs
import numpy as np

from trillium.actors.kv_tiers.block_pool import BlockHash
from trillium.actors.protocol.execute import PromptLogprobs, TokenLogprobs
from trillium.actors.protocol.outputs import DetokenizeSpec, RequestDelta
from trillium.actors.protocol.requests import AddRequest
from trillium.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, its blocks freed
    LOADING = "loading"  # its prefix is being read from the disk tier; out of the queue
    FINISHED_STOPPED = "stop"  # EOS, a stop token id, or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"  # client gone, operator abort, rejected

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason of a finished status, else None."""
        return self.value if self in _FINISHED else None


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)

S = RequestStatus
TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    # A stop string can end a preempted or waiting request: the detokenizer
    # saw its tokens before the preemption.
    S.WAITING: frozenset({S.RUNNING, S.LOADING, S.FINISHED_STOPPED, S.FINISHED_ABORTED}),
    S.RUNNING: frozenset({S.PREEMPTED, *_FINISHED}),
    # Async scheduling: the token of a step in flight when it was preempted can end it (in_flight.py).
    S.PREEMPTED: frozenset({S.RUNNING, S.LOADING, *_FINISHED}),
    # Back to the status it came from once its reads are done.
    S.LOADING: frozenset({S.WAITING, S.PREEMPTED, S.FINISHED_STOPPED, S.FINISHED_ABORTED}),
    S.FINISHED_STOPPED: frozenset(),
    S.FINISHED_LENGTH: frozenset(),
    S.FINISHED_ABORTED: frozenset(),
}
del S

# Request.stream_interval of a final-only request (SamplingParams.final_only): its tokens after the
# first go out in chunks of this many (or at its end). WHY not all at its end: one message then
# carries a whole output (and its logprobs) of any length, and the detokenizer's work on a message
# grows with the square of its text; SGLang likewise sends an unstreamed request's output every
# 50 tokens (scheduler_output_processor_mixin.py DEFAULT_FORCE_STREAM_INTERVAL).
FINAL_ONLY_INTERVAL = 50


class Request:
    """Mutable per-request state owned by the scheduler core."""

    def __init__(self, msg: AddRequest, arrival_seq: int, max_model_len: int) -> None:
        prompt = np.asarray(msg.prompt_token_ids, dtype=np.int32)
        num_prompt = int(prompt.shape[0])
        if num_prompt == 0:
            raise ValueError(f"request {msg.request_id}: empty prompt")
        max_tokens = msg.sampling.max_tokens
        if max_tokens is None:
            max_tokens = max_model_len - num_prompt
        if max_tokens < 1 or num_prompt + max_tokens > max_model_len:
            raise ValueError(
                f"request {msg.request_id}: prompt ({num_prompt} tokens) + max_tokens "
                f"({msg.sampling.max_tokens}) exceeds max_model_len ({max_model_len})"
            )
        self.request_id = msg.request_id
        self.prompt_token_ids = prompt
        self.all_token_ids: list[int] = prompt.tolist()
        self.num_prompt_tokens = num_prompt
        self.sampling = msg.sampling
        self.eos_token_ids = msg.eos_token_ids
        self.max_tokens = max_tokens
        self.arrival_time = msg.arrival_time
        self.arrival_seq = arrival_seq  # tie-break for equal arrival times
        self.priority = msg.priority
        self.group_id = msg.group_id
        self.num_choices = 1  # choices of its AddRequest (core.add_request sets it for n > 1)
        self.lora_id = msg.lora_id
        self.cache_salt = msg.cache_salt
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_hashes: list[BlockHash] = []
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 before
        self.num_preemptions = 0
        self.known_to_executor = False  # sent as NewRequestData at least once
        # Speculative decoding: drafts the executor holds for the next step, and
        # how many of them the step in flight verifies (trillium/speculative/).
        self.num_proposed_drafts = 0
        self.num_scheduled_drafts = 0
        # Steps in flight (scheduler/in_flight.py): output tokens they will sample (ids not
        # known yet), and the tokens they compute (their KV is not written yet).
        self.num_output_placeholders = 0
        self.num_in_flight_tokens = 0
        # Multi-step decode: tokens of the step in flight already sent to the client (AheadTokens).
        self.num_streamed_ahead = 0
        self.delivered = False  # its first delta (with the DetokenizeSpec) went out
        # --stream-interval (or the request's own, or FINAL_ONLY_INTERVAL; set by the core): a delta
        # goes out once this many tokens wait (or the request ends); until then its tokens and
        # logprobs are held here (`delta`), appended a step's tokens at a time.
        self.stream_interval = 1
        self._held_tokens: list[int] = []
        self._held_logprobs: list[TokenLogprobs] = []
        self.stop_reason: int | str | None = None
        self.times = None  # scheduler/metrics.py RequestTimes, set by the core
        self.trace_context = msg.trace_context  # W3C carrier from the api, None when not traced
        self._eos = frozenset(() if msg.sampling.ignore_eos else msg.eos_token_ids)
        self._stop_ids = frozenset(msg.sampling.stop_token_ids)
        self._prompt_logprobs_start = 0
        self._prompt_logprobs: list[TokenLogprobs] = []

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )

    # -- sizes ----------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_planned_tokens(self) -> int:
        """Known tokens plus the placeholders of steps in flight: what the next plan builds on."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_returned_tokens(self) -> int:
        """Computed tokens whose step came back: their KV is written."""
        return self.num_computed_tokens - self.num_in_flight_tokens

    def may_plan_more(self, max_model_len: int) -> bool:
        """False when the placeholders in flight already reach max_tokens or max_model_len:
        the request ends with their result, so it is not planned again (in_flight.py)."""
        if not self.num_output_placeholders:
            return True
        num_outputs = self.num_output_tokens + self.num_output_placeholders
        return num_outputs < self.max_tokens and self.num_planned_tokens < max_model_len

    @property
    def max_kv_tokens(self) -> int:
        """Most tokens whose KV this request can ever hold (the last sampled
        token is never fed back)."""
        return self.num_prompt_tokens + self.max_tokens - 1

    @property
    def sampling_for_executor(self) -> SamplingParams:
        """The params the executor samples with: without the stop strings, which only the
        detokenizer matches (WHY: they may be long, and cross to the executor per choice)."""
        if not self.sampling.stop:
            return self.sampling
        return attrs.evolve(self.sampling, stop=())

    @property
    def reads_prefix_cache(self) -> bool:
        # WHY: prompt logprobs, and a token pooling task's rows (vLLM's skip_reading_prefix_cache,
        # vllm/pooling_params.py), need every prompt position computed (as vLLM).
        return self.sampling.prompt_logprobs is None and not (self.sampling.pooling_task or "").startswith("token_")

    # -- state machine --------------------------------------------------

    def set_status(self, status: RequestStatus) -> None:
        if status not in TRANSITIONS[self.status]:
            raise RuntimeError(
                f"request {self.request_id}: illegal transition {self.status.name} -> {status.name}"
            )
        self.status = status

    # -- tokens and stop rules ------------------------------------------

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """The finished status the just-appended token causes, if any (vLLM's
        order: min_tokens holds off EOS and stop tokens; EOS, then stop token
        ids, then length). Sets stop_reason for a stop token id."""
        if self.num_output_tokens < self.sampling.min_tokens:
            return None
        if token_id in self._eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in self._stop_ids:
            self.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- outputs ---------------------------------------------------------

    def detokenize_spec(self) -> DetokenizeSpec:
        return DetokenizeSpec(
            prompt_token_ids=self.prompt_token_ids,
            skip_special_tokens=self.sampling.skip_special_tokens,
            stop=self.sampling.stop,
            include_stop_str_in_output=self.sampling.include_stop_str_in_output,
            min_tokens=self.sampling.min_tokens,
            spaces_between_special_tokens=self.sampling.spaces_between_special_tokens,
            trace_context=self.trace_context,
            num_choices=self.num_choices,
        )

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Accumulate prompt logprobs over prefill chunks. After a preemption
        the prompt is recomputed; positions already held are skipped."""
        if self.delivered:
            return
        if not self._prompt_logprobs:
            self._prompt_logprobs_start = chunk.start
        end = self._prompt_logprobs_start + len(self._prompt_logprobs)
        skip = max(0, end - chunk.start)
        self._prompt_logprobs.extend(chunk.entries[skip:])

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        if not self._prompt_logprobs:
            return None
        out = PromptLogprobs(self.request_id, self._prompt_logprobs_start, tuple(self._prompt_logprobs))
        self._prompt_logprobs = []
        return out

    def release_held(self) -> RequestDelta | None:
        """The tokens `delta` holds, as a delta now (None: none held). WHY: the request stops
        stepping for a while (preempted, the engine paused or asleep), and tokens it has made
        must not wait for it."""
        return self.delta((), None, None, hold=False) if self._held_tokens else None

    def delta(self, tokens: tuple[int, ...], status: RequestStatus | None,
              logprobs: TokenLogprobs | tuple[TokenLogprobs, ...] | None, pooled=None, *,
              hold: bool = True) -> RequestDelta | None:
        """The scheduler's output for this request now: its new tokens (logprobs: one
        per token, or None), and on the first delta the DetokenizeSpec, prompt logprobs
        and queue time. None while held: with --stream-interval N above 1, tokens after the
        first wait here until N of them wait or the request ends (vLLM's rule), so the
        detokenizer and the api handle one message per N tokens."""
        if isinstance(logprobs, TokenLogprobs):
            logprobs = (logprobs,)
        logprobs = tuple(logprobs or ())
        if hold and status is None and self.delivered and len(self._held_tokens) + len(tokens) < self.stream_interval:
            self._held_tokens.extend(tokens)
            self._held_logprobs.extend(logprobs)
            return None
        if self._held_tokens:
            tokens, logprobs = (*self._held_tokens, *tokens), (*self._held_logprobs, *logprobs)
            self._held_tokens, self._held_logprobs = [], []
        first = not self.delivered
        self.delivered = True
        return RequestDelta(
            request_id=self.request_id,
            new_token_ids=tokens,
            finish_reason=None if status is None else status.finish_reason,
            stop_reason=None if status is None else self.stop_reason,
            logprobs=logprobs,
            prompt_logprobs=self.take_prompt_logprobs() if first else None,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=max(0, self.num_cached_tokens),
            spec=self.detokenize_spec() if first else None,
            queue_time_s=self.times.queue_time_s() if first and self.times is not None else None,
            group_id=self.group_id if first and self.num_choices > 1 else None,
            pooled=pooled,
        )
