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
with that step's result, then the next `schedule()`; with
--async-scheduling two, the second planned while the first runs, over the
first's output placeholders (in_flight.py). Progress is counted when a step
is scheduled; a block full of scheduled tokens is registered in the
prefix cache as it is planned (step_plan.py: a request admitted later in
the same step hits it, since a forward writes every row's KV before any
row reads), so a cached block holds KV by the time a step reading it runs.
`step_plan.py` turns a step's choices into the ExecuteBatch message;
`policy.py` holds the waiting order, the preemption choice and n > 1 gating.
The KV tiers under the pool (host memory, disk) are one component,
`KvTierManager` (kv_tiers/manager.py; NO_KV_TIERS when off): its queued
copies travel in each step's batch, and it holds requests in LOADING while
their prefix is read from disk. Admission of waiting requests is
admission.py. With --num-scheduler-steps K a decoding request may be
scheduled K forwards in one step while nothing waits (multi_step.py: they
ride the speculative draft positions). The executor's side of a batch is
documented on protocol/execute.py `ExecuteBatch`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from trillium.actors.kv_tiers.block_pool import BlockId, BlockPool
from trillium.actors.kv_tiers.manager import NO_KV_TIERS, KvTiers, build_kv_tiers
from trillium.actors.protocol.execute import AheadTokens, BatchResult, ExecuteBatch, KvTransfers
from trillium.actors.protocol.outputs import RequestDelta, SchedulerStats, TokenDeltas
from trillium.actors.protocol.requests import AddRequest
from trillium.actors.protocol.vocabulary import EngineState
from trillium.actors.scheduler.admission import Admission
from trillium.actors.scheduler.config import SchedulerConfig
from trillium.actors.scheduler.grammar_gate import GrammarGate, grammar_key
from trillium.actors.scheduler.in_flight import StepInFlight, StepsInFlight
from trillium.actors.scheduler.request_check import check_add_request
from trillium.actors.scheduler.metrics import StepEvents
from trillium.actors.scheduler.multi_step import extra_forwards, steps_ahead
from trillium.actors.scheduler.policy import SiblingGate, make_policy
from trillium.actors.scheduler.preemption import make_preemption
from trillium.actors.scheduler.queue_timeout import NO_QUEUE_TIMEOUT, QueueTimeout
from trillium.actors.scheduler.request import FINAL_ONLY_INTERVAL, Request, RequestStatus
from trillium.actors.scheduler.step_plan import StepPlan
from trillium.speculative.scheduling import NO_DRAFTS, DraftBudget, build_draft_budget

log = logging.getLogger(__name__)


def build_scheduler(engine) -> "Scheduler":
    """The scheduler for an `EngineConfig` (resolved: num_blocks and max_model_len set)."""
    scheduler = Scheduler(SchedulerConfig.from_engine(engine), kv_tiers=build_kv_tiers(engine),
                          drafts=build_draft_budget(engine.speculative_config))
    if engine.kv_sliding_window:
        log.info("every layer has a %d-token sliding window: the KV blocks behind it are freed, a request holds "
                 "at most %d blocks", engine.kv_sliding_window,
                 scheduler.pool.max_blocks_for(engine.max_model_len, scheduler.config.max_chunk_tokens))
    return scheduler


class Scheduler:
    """Owns the requests and the device block pool; one step at a time.

    `pool` may be passed in (tests); by default it is built from the config,
    over the host tier of `kv_tiers` (a pool passed in must already have it).
    """

    def __init__(self, config: SchedulerConfig, pool: BlockPool | None = None,
                 events: StepEvents | None = None, kv_tiers: KvTiers = NO_KV_TIERS,
                 drafts: DraftBudget = NO_DRAFTS) -> None:
        if pool is None:
            pool = BlockPool(
                config.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                lower_tier=kv_tiers.lower_tier, sliding_window=config.sliding_window,
            )
        if pool.block_size != config.block_size:
            raise ValueError(f"pool block_size {pool.block_size} != config block_size {config.block_size}")
        self.config = config
        self.pool = pool
        self.kv_tiers = kv_tiers
        self.drafts = drafts  # speculative decoding: trillium/speculative/scheduling.py
        self.events = events or StepEvents()
        self._policy = make_policy(config.policy)
        self._preemption = make_preemption(config.preemption_mode, kv_tiers.host)
        self._siblings = SiblingGate()
        self._grammars = GrammarGate()  # structured outputs: grammar_gate.py
        self._admission = Admission(config, pool, self._policy, self._siblings, self._preemption, kv_tiers, self.events,
                                    self._grammars)
        self._queue_timeout = QueueTimeout(config.max_queue_time_s) if config.max_queue_time_s else NO_QUEUE_TIMEOUT
        self._requests: dict[str, Request] = {}
        self._running: list[Request] = []
        self._arrival_seq = 0
        self._step_id = 0
        self._in_flight = StepsInFlight(2 if config.async_scheduling else 1)
        self._last_num_scheduled_tokens = 0
        self._num_preempted_total = 0
        # Reported with the next batch so the executor drops state / blocks.
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        self._pending_deltas: list[RequestDelta] = []
        # Async multi-step decode: AheadTokens of a step behind the oldest in flight (ahead_tokens)
        self._early_ahead: list[AheadTokens] = []
        self.lora_ids: set[int] = set()  # LoRA adapters the executor has (control.py keeps it)
        # Called with every request as it finishes (final status set); the
        # actor sets it when tracing is configured (observability/actor_spans.py).
        self.on_finished: Callable[[Request], None] | None = None

    # -- inputs -----------------------------------------------------------

    def add_request(self, msg: AddRequest) -> None:
        """Queue a request (n > 1: its `choices()`, all or none); ValueError if it can never fit.
        WHY checked here, once: the api is not trusted (request_check.py), and the choices share its prompt."""
        check_add_request(msg, max_model_len=self.config.max_model_len, vocab_size=self.config.vocab_size)
        requests = [self._build(choice, self._arrival_seq + i) for i, choice in enumerate(msg.choices())]
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError(f"duplicate request id in {msg.request_id!r}")
        self._arrival_seq += len(requests)
        for request in requests:
            request.num_choices = len(requests)
            self.pool.update_block_hashes(request)
            self._requests[request.request_id] = request
            self._policy.add(request)
            self._grammars.add(request)

    def _build(self, msg: AddRequest, arrival_seq: int) -> Request:
        if msg.request_id in self._requests:
            raise ValueError(f"duplicate request id {msg.request_id!r}")
        if msg.lora_id and msg.lora_id not in self.lora_ids:
            raise ValueError(f"request {msg.request_id}: LoRA adapter id {msg.lora_id} is not loaded")
        request = Request(msg, arrival_seq, self.config.max_model_len)
        request.stream_interval = self._stream_interval(msg.sampling)
        request.times = self.events.times(msg.arrival_time)
        # WHY the bound, not every token: with a sliding window the blocks behind it are
        # freed as it runs, so a request longer than the cache still fits (block_pool.py).
        num_blocks = self.pool.max_blocks_for(request.max_kv_tokens, self.config.max_chunk_tokens)
        if num_blocks > self.pool.num_usable_blocks:
            raise ValueError(
                f"request {msg.request_id}: up to {request.max_kv_tokens} tokens need "
                f"{num_blocks} KV blocks at once, the cache has {self.pool.num_usable_blocks}"
            )
        return request

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
                self._pending_deltas.append(request.delta((), status, None))

    # -- one step -------------------------------------------------------

    def schedule(self) -> ExecuteBatch | None:
        """Pick this step's work (see the module docstring); None if nothing runs."""
        if self._in_flight.is_full:
            raise RuntimeError(f"step {self._in_flight.oldest_step_id} is in flight: call update_from_output first")
        for request in self._queue_timeout.expired(self._policy, self.events.clock()):
            self._end((request.request_id,), RequestStatus.FINISHED_ABORTED)
        plan = StepPlan(token_budget=self.config.max_num_batched_tokens, pool=self.pool)  # same-step sharing
        self.drafts.begin_step(len(self._running))  # disable_by_batch_size (speculative/scheduling.py)
        self._schedule_running(plan)
        self._preempted_ids.extend(plan.preempted)
        if not plan.preempted:  # WHY: blocks are short; admitting now would thrash
            self._admission.admit_waiting(plan, self._running)
        # WHY no empty step ahead of one in flight: a transfer-only step exists to poll, and the
        # step in flight already brings back what finished.
        if not plan.requests and (len(self._in_flight) or (not self.kv_tiers.must_transfer()
                                                           and not self._grammars.must_poll())):
            return None
        # NOTE: copies queued by a plan that ended empty stay queued for the next
        # batch; until then nothing writes the cache, so they stay valid.
        transfers = self.kv_tiers.take_transfers()
        batch = plan.to_batch(self._step_id, self.pool, tuple(self._finished_ids), tuple(self._preempted_ids),
                              transfers, self._grammars.take_compiles(),
                              propose_drafts=self.drafts.proposes_next(len(self._running)))
        self._finished_ids, self._preempted_ids = [], []
        for request in plan.new:
            request.known_to_executor = True
        placeholders: dict[str, int] = {}
        for request in plan.requests:
            num = plan.num_tokens[request.request_id]
            request.num_computed_tokens += num
            request.num_in_flight_tokens += num
            request.num_scheduled_drafts = plan.num_drafts.get(request.request_id, 0)
            if request.num_computed_tokens - request.num_scheduled_drafts >= request.num_planned_tokens:
                # the step samples it (in_flight.py): one token, with multi-step decode one more per extra
                # forward (speculative drafts are verified: how many it emits is not known ahead)
                sampled = 1 + (0 if self.drafts.k else request.num_scheduled_drafts)
                request.num_output_placeholders += sampled
                placeholders[request.request_id] = sampled
        self._last_num_scheduled_tokens = int(batch.num_scheduled_tokens.sum())
        self._in_flight.sent(StepInFlight(self._step_id, self._last_num_scheduled_tokens, dict(plan.num_tokens),
                                          placeholders))
        self._step_id += 1
        return batch

    def _schedule_running(self, plan: StepPlan) -> None:
        # Multi-step decode (multi_step.py): forwards beyond the first for each decoding request.
        ahead = steps_ahead(self.config.num_scheduler_steps, self._running, len(self._policy),
                            self.pool.num_free_blocks, self.config.block_size)
        for request in list(self._running):
            if plan.token_budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if not request.may_plan_more(self.config.max_model_len):
                continue  # async: a step in flight brings its last token (in_flight.py)
            num = self.config.num_new_tokens(request.num_planned_tokens, request.num_computed_tokens,
                                             plan.token_budget)
            if num <= 0:
                continue
            drafts = 0
            if request.num_proposed_drafts and num == request.num_tokens - request.num_computed_tokens == 1:
                drafts = self.drafts.num_to_verify(request.num_proposed_drafts, plan.token_budget,
                                                   request.num_output_tokens, request.max_tokens,
                                                   request.num_tokens, self.config.max_model_len)
            elif ahead and num == request.num_planned_tokens - request.num_computed_tokens == 1:
                # a decode (async: of the token a step in flight samples); its placeholders count as outputs
                drafts = extra_forwards(ahead, plan.token_budget,
                                        request.num_output_tokens + request.num_output_placeholders,
                                        request.max_tokens, request.num_planned_tokens, self.config.max_model_len)
                # WHY no preemption for them: extra forwards only save hops; a request that must be
                # recomputed for their blocks would cost far more. Without room, one forward.
                new_blocks = self.pool.allocate_slots(request, num + drafts) if drafts else None
                if new_blocks is not None:
                    plan.add(request, num + drafts, new_blocks, is_new=False, num_drafts=drafts)
                    continue
                drafts = 0
            new_blocks = self._allocate_or_preempt(request, num + drafts, plan)
            if new_blocks is not None:
                plan.add(request, num + drafts, new_blocks, is_new=False, num_drafts=drafts)

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

    def _stream_interval(self, sampling) -> int:
        """Tokens a request's delta waits for after its first (Request.delta): the request's
        `stream_interval`, at least the server's (vLLM's clamp: the executor sends a multi-step
        step's tokens ahead every --stream-interval forwards, so no request gets finer chunks);
        a final-only request with no stop string, FINAL_ONLY_INTERVAL or more."""
        interval = max(sampling.stream_interval or 1, self.config.stream_interval)
        if sampling.final_only and not sampling.stop:
            return max(interval, FINAL_ONLY_INTERVAL)
        return interval

    def release_held(self) -> None:
        """Every request's held tokens (--stream-interval) to the pending deltas: the engine is
        about to stop stepping (paused, asleep, nothing runnable), so none waits for a next step."""
        for request in self._requests.values():
            self._release_held(request)

    def _release_held(self, request: Request) -> None:
        delta = request.release_held()
        if delta is not None:
            self._pending_deltas.append(delta)

    def _preempt(self, request: Request, plan: StepPlan, *, may_swap: bool = True) -> None:
        self._release_held(request)  # its tokens so far go out now, not when it runs again
        plan.drop(request)
        swapped = may_swap and self._preemption.swap_out(request, self.pool)  # reads its block table
        self.pool.free(request)
        self._running.remove(request)
        if not swapped:
            request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.num_proposed_drafts = 0  # the executor drops its drafts with its blocks
        request.set_status(RequestStatus.PREEMPTED)
        self._policy.push_front([request])
        self._num_preempted_total += 1
        plan.preempted.append(request.request_id)

    # -- results --------------------------------------------------------

    def update_from_output(self, result: BatchResult) -> TokenDeltas:
        """Append sampled tokens, apply stop rules, cache full blocks, free
        finished requests; one RequestDelta per request that got a token."""
        step = self._in_flight.returned(result.step_id)
        for rid, num in step.num_tokens.items():
            request = self._requests.get(rid)
            if request is not None:  # else it ended while the step ran
                request.num_in_flight_tokens -= num
        now_s = self.events.clock()
        if result.request_ids:  # not a transfer-only batch
            self.events.step(step.num_scheduled_tokens, result.execute_time_s)
        self.events.num_lora_swap_ins += result.lora_swap_ins
        ready = self.kv_tiers.step_done(result, now_s, self.events)
        if ready:  # their disk reads are back: queued again, at the front
            self._policy.push_front(ready)
        failed = self._grammars.step_done(result)
        if failed:
            self._fail_grammars(failed)
        for chunk in result.prompt_logprobs:
            request = self._requests.get(chunk.request_id)
            if request is not None:
                request.add_prompt_logprobs(chunk)
        deltas = []
        pooled = _pooled_by_request(result) if result.pooled_request_ids else {}
        for rid, token in zip(result.request_ids, result.sampled_token_ids.tolist()):
            request = self._requests.get(rid)
            if request is None:
                continue  # aborted or finished while the step ran: its token is dropped
            if token < 0:  # a prefill chunk short of the prompt's end
                if request.status is RequestStatus.RUNNING:
                    self.pool.cache_full_blocks(request, request.num_returned_tokens)
                continue
            request.num_output_placeholders -= step.placeholders.get(rid, 0)
            # A PREEMPTED one: its step was still in flight when it was preempted (async); the
            # token is exact and the executor's copy has it, so it is kept (in_flight.py).
            if request.status not in (RequestStatus.RUNNING, RequestStatus.PREEMPTED):
                continue
            tokens = (token, *result.more_token_ids.get(rid, ()))
            delta, status = self._take_tokens(request, tokens, result, now_s, pooled.get(rid))
            if delta is not None:  # None: held (--stream-interval)
                deltas.append(delta)
            if status is not None:
                self._finish(request, status)
        early, self._early_ahead = self._early_ahead, []
        for message in early:  # the next step's AheadTokens that came before this result: theirs now
            if self._in_flight.holds(message.step_id):
                ahead = self._ahead_deltas(message)
                deltas.extend(ahead.deltas if ahead is not None else ())
        return TokenDeltas(step_id=result.step_id, deltas=tuple(deltas))

    def ahead_tokens(self, message: AheadTokens) -> TokenDeltas | None:
        """Multi-step decode: the tokens an inner forward of the step in flight is about to feed
        (AheadTokens), to the client now. The requests' state waits for the step's result, which
        carries them again; `_take_tokens` then sends only the tokens past them. None when none
        goes out; those of a step that has returned are dropped (its result carried them). With
        async scheduling those of a step behind one still in flight wait for that one's result
        (update_from_output sends them after its tokens). WHY: the executor's results and its
        AheadTokens travel on two tasks, so the next step's first tokens may overtake a result."""
        if not self._in_flight.holds(message.step_id):
            return None
        if message.step_id != self._in_flight.oldest_step_id:
            self._early_ahead.append(message)
            return None
        return self._ahead_deltas(message)

    def _ahead_deltas(self, message: AheadTokens) -> TokenDeltas | None:
        now_s = self.events.clock()
        deltas = []
        for rid, tokens in zip(message.request_ids, message.token_ids.tolist()):
            request = self._requests.get(rid)
            if request is None or request.status not in (RequestStatus.RUNNING, RequestStatus.PREEMPTED):
                continue  # ended while the step runs: as its result's tokens, dropped
            request.num_streamed_ahead += len(tokens)
            # WHY 0 tokens: the result counts the step's kept tokens (an abort or a stop string
            # may end the request before it); here only the time they went out.
            self.events.token(request.times, request.num_prompt_tokens, now_s, 0)
            delta = request.delta(tuple(tokens), None, message.logprobs.get(rid))
            if delta is not None:
                deltas.append(delta)
        return TokenDeltas(step_id=message.step_id, deltas=tuple(deltas)) if deltas else None

    def _take_tokens(self, request: Request, tokens: tuple[int, ...], result: BatchResult, now_s: float,
                     pooled=None):
        """Append a step's tokens (one, or with speculative decoding the accepted run and
        one more), up to the first that finishes the request; roll back rejected drafts.
        The delta carries the tokens not streamed ahead of the result (`ahead_tokens`)."""
        rid = request.request_id
        streamed, request.num_streamed_ahead = request.num_streamed_ahead, 0
        kept: list[int] = []
        status = None
        for token in tokens:
            request.append_token(token)
            kept.append(token)
            status = request.check_stop(token, self.config.max_model_len)
            if status is not None:
                break  # INVARIANT: stop rules hold per token; the rest of the run is dropped
        self.pool.update_block_hashes(request)
        if self.drafts.k:  # speculative decoding
            drafts, request.num_scheduled_drafts = request.num_scheduled_drafts, 0
            if drafts:
                self.drafts.verified(drafts, result.num_accepted_drafts.get(rid, 0))
                # WHY before caching blocks: KV is valid for every token but the last
                # emitted one; rejected drafts' positions must never be registered.
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
                self.pool.trim(request, request.num_computed_tokens)
        # NOTE multi-step decode needs no rollback: a run keeps every forward's token (then its KV is
        # valid for all but the last, as planned), or it ended at a stop token id, which finishes the
        # request here (the executor ends a run only where check_stop would: multi_step.py). Its
        # blocks are cached before it is freed, so only up to the last token fed: KV is written for
        # every token but the last one known, whatever the plan counted (the forwards after a stop).
        request.num_proposed_drafts = result.proposed_drafts.get(rid, 0)
        if request.status is RequestStatus.RUNNING:  # a preempted one holds no blocks
            self.pool.cache_full_blocks(request, min(request.num_returned_tokens, request.num_tokens - 1))
        if streamed >= len(kept):  # INVARIANT (AheadTokens): a run's last token is never streamed
            log.error("request %s: %d tokens streamed ahead of a step that kept %d", rid, streamed, len(kept))
            streamed = len(kept)
        self.events.token(request.times, request.num_prompt_tokens, now_s, len(kept))
        first = result.logprobs.get(rid)
        logprobs = () if first is None else (first, *result.more_logprobs.get(rid, ()))
        return request.delta(tuple(kept[streamed:]), status, logprobs[streamed: len(kept)], pooled), status

    def _fail_grammars(self, failed: dict[str, str]) -> None:
        """Requests waiting for a grammar the executor could not compile end
        with "abort" (the api's check makes this rare: it builds the grammar first)."""
        for request in [r for r in self._policy if grammar_key(r) in failed and not r.known_to_executor]:
            request.stop_reason = f"structured_outputs: {failed[grammar_key(request)]}"
            self._end([request.request_id], RequestStatus.FINISHED_ABORTED)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        elif request.status is not RequestStatus.LOADING:  # a loading one is the tiers' (dropped below)
            self._policy.remove(request)
        self.kv_tiers.dropped(request)
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

    # -- views ------------------------------------------------------------

    @property
    def step_in_flight(self) -> bool:
        """A batch was scheduled and its result has not come back yet."""
        return len(self._in_flight) > 0

    @property
    def may_schedule_ahead(self) -> bool:
        """Another step may go out while one is in flight (--async-scheduling; unset: while at most
        `async_max_running` requests run)."""
        limit = self.config.async_max_running
        return (len(self._in_flight) > 0 and not self._in_flight.is_full
                and (not limit or len(self._running) <= limit))

    def has_work(self) -> bool:
        return bool(self._running) or len(self._policy) > 0 or self.kv_tiers.num_loading > 0

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._policy) + self.kv_tiers.num_loading

    @property
    def num_loading(self) -> int:
        return self.kv_tiers.num_loading

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def running_requests(self) -> tuple[Request, ...]:
        return tuple(self._running)

    def waiting_requests(self) -> tuple[Request, ...]:
        return (*self._policy, *self.kv_tiers.loading_requests())

    def reset_prefix_cache(self, *, keep_disk: bool = False, weight_version: str | None = None) -> int:
        """Forget every cached block, on the host tier too, and the disk tier's
        files unless `keep_disk` (a sleep: the weights that computed them are
        unchanged). New weights (`weight_version`) also move the disk tier to
        that version's directory. Returns the number of entries dropped."""
        self._recompute_swapped()
        dropped = self.pool.reset_prefix_cache()
        return dropped + self.kv_tiers.reset(keep_disk=keep_disk, weight_version=weight_version)

    def reset_disk_tier(self, weight_version: str | None = None) -> int:
        """Delete the disk tier's blocks (and move to `weight_version`'s directory)."""
        return self.kv_tiers.reset_disk(weight_version)

    @property
    def can_keep_prefix_cache(self) -> bool:
        """A sleep can keep the prefix cache: there is a host tier to spill it to."""
        return self.kv_tiers.host is not None

    def spill_prefix_cache(self) -> KvTransfers:
        """Sleep with --sleep-keep-prefix-cache: every cached device block goes
        to the host tier; returns the copies (disk operations first) for the
        executor to run before it frees the cache. NOTE: loads left queued by
        a plan that ended empty are dropped (the host keeps what they load)."""
        self.pool.spill_cached_to_lower()
        return self.kv_tiers.take_transfers()

    def drop_kept_prefix_cache(self) -> None:
        """The sleep failed: the kept host index may name slots the executor never wrote."""
        self.kv_tiers.reset_host()

    # -- lifecycle hooks (driven by scheduler/control.py) ------------------
    # NOTE: freezing needs no hook: the actor simply stops calling schedule().

    def set_admission(self, *, started_only: bool) -> None:
        """started_only: a drain. Requests that already ran (preempted ones
        included) are still admitted so they can finish; new ones wait."""
        self._admission.started_only = started_only

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
            **self._admission.lora_state(self._running),
            **self.kv_tiers.stats(self.pool),
            **self.drafts.stats(),
            **self.events.take(),
        )


def _pooled_by_request(result: BatchResult) -> dict:
    """Each pooled request's output: its row, or its rows under token pooling (pooled_row_offsets)."""
    offsets = result.pooled_row_offsets
    if not len(offsets):
        return dict(zip(result.pooled_request_ids, result.pooled))
    return {rid: result.pooled[int(offsets[i]) : int(offsets[i + 1])]
            for i, rid in enumerate(result.pooled_request_ids)}
