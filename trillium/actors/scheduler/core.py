"""Scheduler core: continuous batching over a paged KV block pool.

Pure synchronous Python (no trio, no zmq, no torch); `actor.py` is its shell.
Consumes AddRequest / AbortRequest / FinishRequest (as calls) and
BatchResult; produces ExecuteBatch, TokenDeltas and SchedulerStats.
State: every live request, the running list, the waiting queue (inside the
policy), the device BlockPool, and ids the executor must hear about.

The idea (vLLM v1): there is no prefill phase and no decode phase. Each
request has `num_computed_tokens` catching up with its `num_tokens` (prompt
plus outputs so far). A step hands out a token budget: running requests
first, in order (a decode needs one token, a prefill chunk as many as the
budget allows), then waiting requests in policy order, each starting after
its prefix-cache hit. When a running request cannot get a block, running
requests are preempted (blocks freed, back to the front of the queue) until
it can, possibly itself: by recompute (progress reset), or with
`--preemption-mode swap` their KV waits in the host tier (preemption.py).

One step is in flight at a time: `schedule()`, then `update_from_output()`
with that step's result, then the next `schedule()`. Progress is counted
when a step is scheduled; blocks are registered in the prefix cache only
when its result comes back, so a cached block always holds computed KV.
`step_plan.py` turns a step's choices into the ExecuteBatch message;
`policy.py` holds the waiting order, the preemption choice and n > 1 gating.
A host KV tier (kv_tiers/host.py), when configured, sits under the pool:
the copies it queues while a step is planned travel in that step's batch.
A disk tier (kv_tiers/disk.py) sits under the host tier: a waiting request
whose prefix continues on disk goes to LOADING (out of the queue, no device
blocks) while the executor reads those blocks into host slots in the
background; other requests keep stepping, and once its reads are back it is
queued again at the front and its prefix hits in the host tier. A failed
read only shortens the hit: those tokens are recomputed. While only loading
requests are left, transfer-only batches (no requests) carry the disk
operations and bring the completions back.

Executor contract for an ExecuteBatch: apply `finished_request_ids` and
`preempted_request_ids` first, then `new_requests` (replacing any state of a
resumed request but its sampling state), then `cached`. Request i computes
`num_scheduled_tokens[i]` tokens from its num_computed_tokens, and is sampled
iff num_computed_tokens + num_scheduled_tokens == its number of known tokens
(NewRequestData.token_ids plus every token the executor sampled for it since).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from trillium.actors.kv_tiers.block_pool import BlockId, BlockPool, PrefixHit
from trillium.actors.kv_tiers.disk import DiskTier
from trillium.actors.kv_tiers.host import NO_TRANSFERS, HostTier, tier_stats
from trillium.actors.protocol.execute import BatchResult, ExecuteBatch, TokenLogprobs
from trillium.actors.protocol.outputs import RequestDelta, SchedulerStats, TokenDeltas
from trillium.actors.protocol.requests import AddRequest
from trillium.actors.protocol.vocabulary import EngineState
from trillium.actors.scheduler.metrics import StepEvents
from trillium.actors.scheduler.policy import SiblingGate, make_policy
from trillium.actors.scheduler.preemption import PREEMPTION_MODES, make_preemption
from trillium.actors.scheduler.request import Request, RequestStatus
from trillium.actors.scheduler.step_plan import StepPlan


def _positive(instance, attribute, value) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value}")


@attrs.frozen
class SchedulerConfig:
    num_blocks: int = attrs.field(validator=_positive)
    block_size: int = attrs.field(default=16, validator=_positive)
    max_num_seqs: int = attrs.field(default=256, validator=_positive)
    max_num_batched_tokens: int = attrs.field(default=8192, validator=_positive)
    max_model_len: int = attrs.field(default=4096, validator=_positive)
    enable_prefix_caching: bool = True
    policy: str = attrs.field(default="fcfs", validator=attrs.validators.in_(("fcfs", "priority")))
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0 = off; else cap a prefill's tokens per step
    max_loras: int = 0  # distinct LoRA adapters among running requests; 0 = LoRA off (lora_id must be 0)
    # recompute | swap (preempted requests' KV waits in the host tier: needs one)
    preemption_mode: str = attrs.field(default="recompute", validator=attrs.validators.in_(PREEMPTION_MODES))

    def __attrs_post_init__(self) -> None:
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold splits prompts: it needs chunked prefill")


def build_scheduler(engine) -> "Scheduler":
    """The scheduler for an `EngineConfig` (resolved: num_blocks and max_model_len set)."""
    config = SchedulerConfig(
        num_blocks=engine.num_blocks,
        block_size=engine.block_size,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
        enable_prefix_caching=engine.enable_prefix_caching,
        policy=engine.scheduling_policy,
        max_loras=engine.max_loras if engine.enable_lora else 0,
        preemption_mode=engine.preemption_mode,
    )
    host_tier = None
    if engine.num_host_blocks:
        disk = None
        if engine.kv_disk_path:
            disk = DiskTier(engine.kv_disk_path, engine.kv_disk_model_fingerprint, engine.num_disk_blocks,
                            engine.kv_eviction_policy, engine.kv_block_bytes)
        host_tier = HostTier(engine.num_host_blocks, engine.kv_eviction_policy, engine.kv_block_bytes, disk=disk)
    return Scheduler(config, host_tier=host_tier)


class Scheduler:
    """Owns the requests and the device block pool; one step at a time.

    `pool` may be passed in (tests, a tier manager sharing it); by default
    it is built from the config, over `host_tier` when one is given (a
    pool passed in must already have it as its lower tier).
    """

    def __init__(self, config: SchedulerConfig, pool: BlockPool | None = None,
                 events: StepEvents | None = None, host_tier: HostTier | None = None) -> None:
        if pool is None:
            pool = BlockPool(
                config.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                lower_tier=host_tier,
            )
        if pool.block_size != config.block_size:
            raise ValueError(f"pool block_size {pool.block_size} != config block_size {config.block_size}")
        self.config = config
        self.pool = pool
        self.host_tier = host_tier
        self._policy = make_policy(config.policy)
        self._preemption = make_preemption(config.preemption_mode, host_tier)
        self._siblings = SiblingGate()
        self._requests: dict[str, Request] = {}
        self._running: list[Request] = []
        # Disk tier: requests waiting for their reads, and who each read is for.
        self._loading: dict[str, Request] = {}
        self._fetch_owner: dict[int, str] = {}
        self._arrival_seq = 0
        self._step_id = 0
        self._in_flight_step: int | None = None
        self._last_num_scheduled_tokens = 0
        self._num_preempted_total = 0
        # Reported with the next batch so the executor drops state / blocks.
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        self._pending_deltas: list[RequestDelta] = []
        # Draining (scheduler/lifecycle.py): admit only requests that ran before.
        self._admit_started_only = False
        self.events = events or StepEvents()
        self.lora_ids: set[int] = set()  # LoRA adapters the executor has (control.py keeps it)
        # Called with every request as it finishes (final status set); the
        # actor sets it when tracing is configured (observability/actor_spans.py).
        self.on_finished: Callable[[Request], None] | None = None

    # -- inputs -----------------------------------------------------------

    def add_request(self, msg: AddRequest) -> None:
        """Queue a request; ValueError if it can never fit."""
        if msg.request_id in self._requests:
            raise ValueError(f"duplicate request id {msg.request_id!r}")
        if msg.lora_id and msg.lora_id not in self.lora_ids:
            raise ValueError(f"request {msg.request_id}: LoRA adapter id {msg.lora_id} is not loaded")
        request = Request(msg, self._arrival_seq, self.config.max_model_len)
        request.times = self.events.times(msg.arrival_time)
        num_blocks = self.pool.blocks_needed(request.max_kv_tokens)
        if num_blocks > self.pool.num_blocks:
            raise ValueError(
                f"request {msg.request_id}: up to {request.max_kv_tokens} tokens need "
                f"{num_blocks} KV blocks, the cache has {self.pool.num_blocks}"
            )
        self._arrival_seq += 1
        self.pool.update_block_hashes(request)
        self._requests[request.request_id] = request
        self._policy.add(request)

    def abort(self, request_ids) -> None:
        """Client gone / operator abort: free blocks now; a final "abort" delta
        is queued for `take_pending_deltas`. Unknown ids are ignored."""
        self._end(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish(self, request_ids) -> None:
        """A stop string matched (detokenizer): finish with reason "stop"."""
        self._end(request_ids, RequestStatus.FINISHED_STOPPED)

    def reject(self, request_id: str, reason: str) -> None:
        """Queue an "abort" delta for a request add_request refused."""
        self._pending_deltas.append(
            RequestDelta(request_id=request_id, new_token_ids=(), finish_reason="abort", stop_reason=reason)
        )

    def take_pending_deltas(self) -> TokenDeltas | None:
        """Deltas produced outside a step (aborts, finishes, rejects)."""
        if not self._pending_deltas:
            return None
        deltas, self._pending_deltas = tuple(self._pending_deltas), []
        return TokenDeltas(step_id=self._step_id, deltas=deltas)

    def _end(self, request_ids, status: RequestStatus) -> None:
        for rid in request_ids:
            request = self._requests.get(rid)
            if request is not None:
                self._finish(request, status)
                self._pending_deltas.append(self._delta(request, (), status, None))

    # -- one step -------------------------------------------------------

    def schedule(self) -> ExecuteBatch | None:
        """Pick this step's work (see the module docstring); None if nothing runs."""
        if self._in_flight_step is not None:
            raise RuntimeError(f"step {self._in_flight_step} is in flight: call update_from_output first")
        plan = StepPlan(token_budget=self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        self._preempted_ids.extend(plan.preempted)
        if not plan.preempted:  # WHY: blocks are short; admitting now would thrash
            self._schedule_waiting(plan)
        if not plan.requests and not self._must_transfer():
            return None
        # NOTE: copies queued by a plan that ended empty stay queued for the next
        # batch; until then nothing writes the cache, so they stay valid.
        transfers = NO_TRANSFERS if self.host_tier is None else self.host_tier.take_transfers()
        batch = plan.to_batch(self._step_id, self.pool, tuple(self._finished_ids), tuple(self._preempted_ids),
                              transfers)
        self._finished_ids, self._preempted_ids = [], []
        for request in plan.new:
            request.known_to_executor = True
        for request in plan.requests:
            request.num_computed_tokens += plan.num_tokens[request.request_id]
        self._last_num_scheduled_tokens = int(batch.num_scheduled_tokens.sum())
        self._in_flight_step = self._step_id
        self._step_id += 1
        return batch

    def _must_transfer(self) -> bool:
        """Nothing to run, but disk reads are in flight or disk operations are
        queued: a transfer-only batch carries them and fetches the completions."""
        tier = self.host_tier
        return tier is not None and tier.disk is not None and (tier.num_fetching > 0 or tier.disk.has_ops)

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int) -> int:
        """Tokens to compute for a request this step; 0 if it must wait."""
        num = request.num_tokens - num_computed
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num:
            num = threshold
        if num > budget:
            return budget if self.config.enable_chunked_prefill else 0
        return num

    def _schedule_running(self, plan: StepPlan) -> None:
        for request in list(self._running):
            if plan.token_budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num = self._num_new_tokens(request, request.num_computed_tokens, plan.token_budget)
            if num <= 0:
                continue
            new_blocks = self._allocate_or_preempt(request, num, plan)
            if new_blocks is not None:
                plan.add(request, num, new_blocks, is_new=False)

    def _allocate_or_preempt(
        self, request: Request, num_tokens: int, plan: StepPlan
    ) -> list[BlockId] | None:
        while True:
            new_blocks = self.pool.allocate_slots(request, num_tokens)
            if new_blocks is not None:
                return new_blocks
            victim = self._policy.pick_victim(self._running)
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _preempt(self, request: Request, plan: StepPlan, *, may_swap: bool = True) -> None:
        plan.drop(request)
        swapped = may_swap and self._preemption.swap_out(request, self.pool)  # reads its block table
        self.pool.free(request)
        self._running.remove(request)
        if not swapped:
            request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.set_status(RequestStatus.PREEMPTED)
        self._policy.push_front([request])
        self._num_preempted_total += 1
        plan.preempted.append(request.request_id)

    def _admit_swapped(self, request: Request, plan: StepPlan) -> bool:
        """Re-admit a swapped-out request: fresh blocks for its KV and the new
        tokens, its KV loaded back into them; no prefix-cache lookup."""
        num = self._num_new_tokens(request, request.num_computed_tokens, plan.token_budget)
        if num <= 0:
            return False
        new_blocks = self._preemption.swap_in(request, self.pool, num)
        if new_blocks is None:
            return False
        request.set_status(RequestStatus.RUNNING)
        self._running.append(request)
        self._siblings.admitted(request)
        plan.add(request, num, new_blocks, is_new=True)
        return True

    def _schedule_waiting(self, plan: StepPlan) -> None:
        put_back: list[Request] = []
        while len(self._policy) and len(self._running) < self.config.max_num_seqs and plan.token_budget > 0:
            request = self._policy.pop()
            if self._siblings.must_wait(request) or (self._admit_started_only and not request.known_to_executor):
                put_back.append(request)
                continue
            if not self._lora_fits(request):
                # WHY skip, not stop: its adapter needs a slot; requests for resident
                # adapters (or the base model) may go first, as vLLM does.
                put_back.append(request)
                continue
            if self._preemption.is_swapped(request):
                admitted = self._admit_swapped(request, plan)
            else:
                hit = self.pool.get_computed_blocks(request)  # one lookup serves both below
                if self._start_loading(request, hit):
                    continue  # out of the queue until its disk reads are back
                admitted = self._admit(request, hit, plan)
            if not admitted:
                put_back.append(request)
                break  # WHY: strict order; a later, smaller request must not starve this one
        self._policy.push_front(put_back)

    def _start_loading(self, request: Request, hit: PrefixHit) -> bool:
        """If the request's prefix continues on disk past its device and host
        hits (`hit`), start reading those blocks into host slots and move it to
        LOADING. Once per request: the second time it is admitted as is."""
        tier = self.host_tier
        if tier is None or tier.disk is None or request.disk_fetched or not request.reads_prefix_cache:
            return False
        max_blocks = (request.num_tokens - 1) // self.config.block_size
        rest = request.block_hashes[hit.num_computed_tokens // self.config.block_size : max_blocks]
        num = tier.disk_hits(rest)
        if not num:
            return False
        request.disk_fetched = True
        first = len(hit.block_ids)
        host_hits = request.block_hashes[first : first + len(hit.lower_slots)]
        tier.pin(host_hits)  # WHY: in a small host tier its own fetches would evict them
        request.pinned_hashes.extend(host_hits)
        slots = tier.start_fetch(rest[:num])
        if not slots:
            self._unpin(request)
            return False
        for slot in slots:
            self._fetch_owner[slot] = request.request_id
        request.pending_fetches = len(slots)
        request.loading_since = self.events.clock()
        request.status_before_loading = request.status
        request.set_status(RequestStatus.LOADING)
        self._loading[request.request_id] = request
        return True

    def _fetches_done(self, result: BatchResult) -> None:
        """Disk reads that came back: good blocks join the host tier; a request
        whose reads are all back is queued again, at the front."""
        done = [(int(s), True) for s in result.kv_fetched_host_slots]
        done += [(int(s), False) for s in result.kv_fetch_failed_host_slots]
        ready = []
        for slot, ok in done:
            request = self._loading.get(self._fetch_owner.pop(slot, ""))
            # WHY pin: in a small host tier other fetches could evict it before its request runs.
            block_hash = self.host_tier.fetch_done(slot, ok, pin=request is not None)
            if request is None:
                continue  # aborted or finished while loading
            if ok and block_hash is not None:
                request.pinned_hashes.append(block_hash)
            request.pending_fetches -= 1
            if request.pending_fetches == 0:
                del self._loading[request.request_id]
                request.set_status(request.status_before_loading)
                self.events.kv_load("disk", self.events.clock() - request.loading_since)
                ready.append(request)
        if ready:
            ready.sort(key=lambda r: r.arrival_seq)
            self._policy.push_front(ready)

    def _unpin(self, request: Request) -> None:
        if request.pinned_hashes:
            self.host_tier.unpin(request.pinned_hashes)
            request.pinned_hashes = []

    def _lora_fits(self, request: Request) -> bool:
        """Admitting `request` keeps the running adapters within the device slots."""
        if not request.lora_id:
            return True
        active = {r.lora_id for r in self._running if r.lora_id}
        return request.lora_id in active or len(active) < self.config.max_loras

    def _admit(self, request: Request, hit: PrefixHit, plan: StepPlan) -> bool:
        """Admit a waiting request after its prefix-cache `hit`; False if it must wait."""
        num = self._num_new_tokens(request, hit.num_computed_tokens, plan.token_budget)
        if num <= 0:
            return False
        new_blocks = self.pool.allocate_slots(request, num, hit)
        if new_blocks is None:
            return False
        request.num_computed_tokens = hit.num_computed_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = hit.num_computed_tokens
        request.set_status(RequestStatus.RUNNING)
        self._unpin(request)  # its host hits are reserved (or it was a miss after all)
        self.events.scheduled(request.times)
        self._running.append(request)
        self._siblings.admitted(request)
        plan.add(request, num, new_blocks, is_new=True)
        return True

    # -- results --------------------------------------------------------

    def update_from_output(self, result: BatchResult) -> TokenDeltas:
        """Append sampled tokens, apply stop rules, cache full blocks, free
        finished requests; one RequestDelta per request that got a token."""
        if result.step_id != self._in_flight_step:
            raise ValueError(f"result of step {result.step_id}, but step {self._in_flight_step} is in flight")
        self._in_flight_step = None
        now_s = self.events.clock()
        if result.request_ids:  # not a transfer-only batch
            self.events.step(self._last_num_scheduled_tokens, result.execute_time_s)
        self.events.num_lora_swap_ins += result.lora_swap_ins
        if result.kv_host_load_s:
            self.events.kv_load("host", result.kv_host_load_s)
        if len(result.kv_fetched_host_slots) or len(result.kv_fetch_failed_host_slots):
            self._fetches_done(result)
        for chunk in result.prompt_logprobs:
            request = self._requests.get(chunk.request_id)
            if request is not None:
                request.add_prompt_logprobs(chunk)
        deltas = []
        for rid, token in zip(result.request_ids, result.sampled_token_ids.tolist()):
            request = self._requests.get(rid)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or finished while the step ran
            if token >= 0:
                request.append_token(token)
                self.pool.update_block_hashes(request)
            self.pool.cache_full_blocks(request)
            if token < 0:
                continue  # a prefill chunk short of the prompt's end
            self.events.token(request.times, request.num_prompt_tokens, now_s)
            status = request.check_stop(token, self.config.max_model_len)
            deltas.append(self._delta(request, (token,), status, result.logprobs.get(rid)))
            if status is not None:
                self._finish(request, status)
        return TokenDeltas(step_id=result.step_id, deltas=tuple(deltas))

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        elif request.status is RequestStatus.LOADING:
            del self._loading[request.request_id]  # its reads still land in the host tier
        else:
            self._policy.remove(request)
        self._unpin(request)
        request.set_status(status)
        self.events.finished_request(request.times, status.finish_reason, request.num_prompt_tokens,
                                     request.num_output_tokens, request.num_preemptions)
        if self.on_finished is not None:
            self.on_finished(request)
        self.pool.free(request)
        self._preemption.drop(request)
        self._siblings.finished(request)
        del self._requests[request.request_id]
        if request.known_to_executor:
            self._finished_ids.append(request.request_id)

    def _delta(
        self,
        request: Request,
        tokens: tuple[int, ...],
        status: RequestStatus | None,
        logprobs: TokenLogprobs | None,
    ) -> RequestDelta:
        first = not request.delivered
        request.delivered = True
        return RequestDelta(
            request_id=request.request_id,
            new_token_ids=tokens,
            finish_reason=None if status is None else status.finish_reason,
            stop_reason=None if status is None else request.stop_reason,
            logprobs=() if logprobs is None else (logprobs,),
            prompt_logprobs=request.take_prompt_logprobs() if first else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(0, request.num_cached_tokens),
            spec=request.detokenize_spec() if first else None,
            queue_time_s=request.times.queue_time_s() if first and request.times is not None else None,
        )

    # -- views ------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._running) or len(self._policy) > 0 or bool(self._loading)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._policy) + len(self._loading)

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def running_requests(self) -> tuple[Request, ...]:
        return tuple(self._running)

    def waiting_requests(self) -> tuple[Request, ...]:
        return (*self._policy, *self._loading.values())

    def reset_prefix_cache(self, *, keep_disk: bool = False, weight_version: str | None = None) -> int:
        """Forget every cached block, on the host tier too, and the disk tier's
        files unless `keep_disk` (a sleep: the weights that computed them are
        unchanged). New weights (`weight_version`) also move the disk tier to
        that version's directory. Returns the number of entries dropped."""
        self._recompute_swapped()
        dropped = self.pool.reset_prefix_cache()
        if self.host_tier is not None:
            dropped += self.host_tier.reset()
            if self.host_tier.disk is not None and not keep_disk:
                dropped += self.host_tier.disk.reset(weight_version)
        return dropped

    def reset_disk_tier(self, weight_version: str | None = None) -> int:
        """Delete the disk tier's blocks (and move to `weight_version`'s directory)."""
        tier = self.host_tier
        return 0 if tier is None or tier.disk is None else tier.disk.reset(weight_version)

    # -- lifecycle hooks (driven by scheduler/control.py) ------------------
    # NOTE: freezing needs no hook: the actor simply stops calling schedule().

    def set_admission(self, *, started_only: bool) -> None:
        """started_only: a drain. Requests that already ran (preempted ones
        included) are still admitted so they can finish; new ones wait."""
        self._admit_started_only = started_only

    def has_started_requests(self) -> bool:
        """Any request a drain must still wait for (running, or preempted)."""
        return bool(self._running) or any(r.known_to_executor for r in self._policy)

    def num_requests_using_lora(self, lora_id: int) -> int:
        return sum(1 for r in self._requests.values() if r.lora_id == lora_id)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def preempt_running(self) -> int:
        """The KV cache is about to be freed (sleep): every running request goes
        back to the front of the queue, to recompute when stepping resumes.
        Call only between steps. Returns the number preempted."""
        plan = StepPlan(token_budget=0)
        for request in reversed(list(self._running)):  # each goes to the front: keep order
            self._preempt(request, plan, may_swap=False)
        self._preempted_ids.extend(plan.preempted)
        self._recompute_swapped()
        return len(plan.preempted)

    def _recompute_swapped(self) -> None:
        """Swapped-out requests give up their host copies and recompute.

        WHY on every prefix-cache reset and sleep, even when the weights stay:
        the saves of a swap-out whose plan ended empty have not run yet, and
        after a sleep they would read a freed (then reallocated) cache; after
        new weights the copies are stale. Recompute is always correct, and
        these are rare operations. Sleep never swaps out (`may_swap=False`)
        for the same reason.
        """
        for request_id in self._preemption.drop_all():
            self._requests[request_id].num_computed_tokens = 0

    def _lora_state(self) -> dict:
        """SchedulerStats' LoRA fields; nothing to scan when LoRA is off (every step calls stats)."""
        if not self.config.max_loras:
            return {}
        return dict(
            running_lora_ids=tuple(sorted({r.lora_id for r in self._running if r.lora_id})),
            waiting_lora_ids=tuple(sorted({r.lora_id for r in self._policy if r.lora_id})),
            max_loras=self.config.max_loras,
        )

    def stats(self, *, engine_state: EngineState = EngineState.SERVING, weight_version: str = "0",
              mailbox_depth: int = 0) -> SchedulerStats:
        """The state now, and (drained) the request and step events since the last call."""
        return SchedulerStats(
            step_id=self._step_id,
            num_running=len(self._running),
            num_waiting=self.num_waiting,
            num_preempted_total=self._num_preempted_total,
            num_swapped_out_total=self._preemption.num_swapped_out_total,
            num_swapped_in_total=self._preemption.num_swapped_in_total,
            kv_usage=self.pool.usage,
            num_free_blocks=self.pool.num_free_blocks,
            prefix_cache_queries_total=self.pool.prefix_cache_query_tokens,
            prefix_cache_hits_total=self.pool.prefix_cache_hit_tokens,
            num_scheduled_tokens=self._last_num_scheduled_tokens,
            engine_state=engine_state,
            weight_version=weight_version,
            mailbox_depth=mailbox_depth,
            **self._lora_state(),
            **({} if self.host_tier is None else tier_stats(self.pool, self.host_tier)),
            **self.events.take(),
        )
