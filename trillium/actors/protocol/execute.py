"""scheduler <-> executor: one step of work and its result.

Pattern: scheduler PUSH -> executor PULL (executor binds its inbox);
executor PUSH -> scheduler PULL (scheduler's inbox).

Send once, then diffs: a request's tokens and sampling params cross once in
`NewRequestData` (again after a preemption, as a resumed request); every
later step carries only its new blocks and token count, columnar, so a
64-request decode step is a handful of small arrays.
"""

from __future__ import annotations

import attrs
import numpy as np

from trillium.sampling_params import SamplingParams


@attrs.frozen
class NewRequestData:
    """First scheduling of a request (or re-scheduling after preemption)."""

    request_id: str
    token_ids: np.ndarray  # int32: prompt followed by outputs generated so far
    num_prompt_tokens: int
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: np.ndarray  # int32
    num_computed_tokens: int  # prefix-cache hit (tokens already in the blocks)
    lora_id: int = 0


@attrs.frozen
class CachedRequests:
    """Diffs for requests the executor already knows, columnar."""

    request_ids: tuple[str, ...] = ()
    num_computed_tokens: np.ndarray = attrs.field(factory=lambda: np.zeros(0, np.int32))
    # New blocks of request i: new_block_ids[new_block_offsets[i]:new_block_offsets[i+1]]
    new_block_ids: np.ndarray = attrs.field(factory=lambda: np.zeros(0, np.int32))
    new_block_offsets: np.ndarray = attrs.field(factory=lambda: np.zeros(1, np.int32))


def _int32s() -> np.ndarray:
    return np.zeros(0, np.int32)


@attrs.frozen
class KvTransfers:
    """One step's copies between the device KV cache, the host tier and the
    disk tier (kv_tiers/manager.py queues them; executor/kv_stores.py applies
    them, in this order, before anything writes the cache):

        1. disk ops      kv_tiers/disk.py DiskOp codes, in order, with their
                         host slots (-1: none) and block hashes (CLEAR: the
                         new directory). WHY first: a WRITE reads a host
                         slot that this step's saves may reuse.
        2. saves         device block save_block_ids[i] -> host slot save_host_slots[i]
        3. loads         host slot load_host_slots[j] -> device block load_block_ids[j]

    Travels inside `ExecuteBatch` (every step) and the forwarded `Sleep`
    (--sleep-keep-prefix-cache: the spilled prefix cache; no loads).
    """

    save_block_ids: np.ndarray = attrs.field(factory=_int32s)
    save_host_slots: np.ndarray = attrs.field(factory=_int32s)
    load_host_slots: np.ndarray = attrs.field(factory=_int32s)
    load_block_ids: np.ndarray = attrs.field(factory=_int32s)
    disk_ops: np.ndarray = attrs.field(factory=lambda: np.zeros(0, np.int8))
    disk_host_slots: np.ndarray = attrs.field(factory=_int32s)
    disk_hashes: tuple[bytes, ...] = ()

    @property
    def empty(self) -> bool:
        return not len(self.save_block_ids) and not len(self.load_block_ids) and not len(self.disk_ops)


NO_TRANSFERS = KvTransfers()
"""No copies (treat as read-only: its arrays are shared)."""


@attrs.frozen
class ExecuteBatch:
    """Run one forward over the scheduled tokens and sample where due.

    Batch order is new requests first, then cached ones;
    `num_scheduled_tokens[i]` tokens of request i are computed, starting at
    its num_computed_tokens. A request is sampled when its scheduled tokens
    reach the end of its known tokens.

    Executor contract: apply `kv` first (KvTransfers, before anything writes
    the cache), then `finished_request_ids` and `preempted_request_ids`, then
    `new_requests` (replacing any state of a resumed request but its sampling
    state), then `cached`. Request i is sampled iff num_computed_tokens +
    num_scheduled_tokens == its number of known tokens (NewRequestData.token_ids
    plus every token the executor sampled for it since).
    """

    step_id: int
    new_requests: tuple[NewRequestData, ...]
    cached: CachedRequests
    num_scheduled_tokens: np.ndarray  # int32 [num_new + num_cached]
    finished_request_ids: tuple[str, ...] = ()  # drop state
    preempted_request_ids: tuple[str, ...] = ()  # drop blocks, keep sampling state
    kv: KvTransfers = attrs.field(factory=lambda: NO_TRANSFERS)  # KV tier copies, before the forward
    # Structured outputs (scheduler/grammar_gate.py): grammars to compile off
    # the step's path, by StructuredOutputsParams.key; answered in a later BatchResult.
    compile_grammars: tuple[str, ...] = ()
    # Speculative decoding (trillium/speculative/): of request i's scheduled tokens, the
    # last num_draft_tokens[i] are the first drafts the executor proposed for it (the
    # executor holds them). Empty: no drafts in this step. Request i is sampled (verified)
    # iff num_computed_tokens + num_scheduled_tokens - num_draft_tokens == its known tokens.
    # Multi-step decode (--num-scheduler-steps, scheduler/multi_step.py) uses the same field with no
    # proposer: request i's last num_draft_tokens[i] positions are forwards the executor runs one
    # after another, each feeding the token the one before it sampled (more_token_ids).
    num_draft_tokens: np.ndarray = attrs.field(factory=_int32s)
    # False: propose no drafts after this step (the next one verifies none: more requests
    # run than disable_by_batch_size, speculative/scheduling.py). A proposer that keeps its
    # own cache of the target's tokens (eagle) still takes the step's rows.
    propose_drafts: bool = True


@attrs.frozen
class TokenLogprobs:
    """Logprobs of one sampled position: the sampled token first, then top-N."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@attrs.frozen
class PromptLogprobs:
    """Logprobs of prompt tokens start..start+len-1 (position 0 has none)."""

    request_id: str
    start: int
    entries: tuple[TokenLogprobs, ...]


@attrs.frozen
class BatchResult:
    """Sampled tokens of one ExecuteBatch, in batch order; -1 = not sampled
    (a prefill chunk that has not reached the end of the prompt)."""

    step_id: int
    request_ids: tuple[str, ...]
    sampled_token_ids: np.ndarray  # int32 [num_requests]
    # Only for requests that asked for logprobs: request_id -> logprobs.
    logprobs: dict[str, TokenLogprobs] = attrs.field(factory=dict)
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    execute_time_s: float = 0.0
    lora_swap_ins: int = 0  # adapters loaded into a device slot for this step
    # Disk reads into host slots that completed since the last result (any step's).
    kv_fetched_host_slots: np.ndarray = attrs.field(factory=lambda: np.zeros(0, np.int32))
    kv_fetch_failed_host_slots: np.ndarray = attrs.field(factory=lambda: np.zeros(0, np.int32))
    kv_host_load_s: float = 0.0  # time of this step's host -> device copies (0: none)
    # Grammar compiles finished since the last result (any step's), by key;
    # evicted: compiled grammars the executor no longer holds.
    grammars_ready: tuple[str, ...] = ()
    grammars_failed: dict[str, str] = attrs.field(factory=dict)
    grammars_evicted: tuple[str, ...] = ()
    # Pooling models (executor/pooler.py): requests whose prompt finished this step and
    # their pooled outputs, row i for pooled_request_ids[i] (float32 [N, output_size]).
    # Their sampled_token_ids entry is a placeholder that ends them (max_tokens=1).
    pooled_request_ids: tuple[str, ...] = ()
    pooled: np.ndarray = attrs.field(factory=lambda: np.zeros((0, 0), np.float32))
    # Token pooling (ALL / STEP): request i's rows are pooled[offsets[i]:offsets[i + 1]]
    # (int64 [N + 1]); empty: one row per request.
    pooled_row_offsets: np.ndarray = attrs.field(factory=lambda: np.zeros(0, np.int64))
    # Speculative decoding: a verified request emitted sampled_token_ids[i] and then
    # more_token_ids[id] (with more_logprobs[id] when it asked for logprobs), after
    # accepting num_accepted_drafts[id] of its drafts. proposed_drafts[id]: drafts the
    # executor now holds for the request's next step (only requests that have some).
    more_token_ids: dict[str, tuple[int, ...]] = attrs.field(factory=dict)
    more_logprobs: dict[str, tuple[TokenLogprobs, ...]] = attrs.field(factory=dict)
    num_accepted_drafts: dict[str, int] = attrs.field(factory=dict)
    proposed_drafts: dict[str, int] = attrs.field(factory=dict)


@attrs.frozen
class AheadTokens:
    """executor -> scheduler, while a multi-step decode step runs (scheduler/multi_step.py): the
    tokens its forwards sampled since the last AheadTokens (every --stream-interval forwards),
    for each request whose run goes on, so the client gets them now rather than with the
    step's BatchResult, which carries all of the step's tokens all the same.

    INVARIANT: never a request's last token of the step (a run's last token may finish the
    request; it comes with the BatchResult only), so a streamed token is never one past a stop."""

    step_id: int
    request_ids: tuple[str, ...]
    token_ids: np.ndarray  # int32 [num_requests, num_tokens]: every request got the same forwards
    # Requests that asked for logprobs: one entry per token.
    logprobs: dict[str, tuple[TokenLogprobs, ...]] = attrs.field(factory=dict)


@attrs.frozen
class ExecutorFailed:
    """executor -> scheduler: a step raised; the engine must stop."""

    step_id: int
    error: str


MESSAGES = (
    KvTransfers,
    NewRequestData,
    CachedRequests,
    ExecuteBatch,
    TokenLogprobs,
    PromptLogprobs,
    BatchResult,
    AheadTokens,
    ExecutorFailed,
)
