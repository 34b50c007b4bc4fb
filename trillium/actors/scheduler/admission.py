"""Admission: which waiting requests join the running list this step.

A component of the scheduler core (core.py builds it over the core's own
pool, waiting policy, sibling gate, preemption mode, KV tiers and events;
it keeps no request state of its own). Each step, after the running
requests took their tokens, `admit_waiting` pops waiting requests in policy
order while there is token budget and a free sequence slot:

    n > 1 sibling not yet due, or a drain holds new ones  -> put back, next
    its LoRA adapter needs a device slot none can give    -> put back, next
    its grammar is still compiling (grammar_gate.py)      -> put back, next
    swapped out (preemption.py)                           -> fresh blocks, KV copied back
    prefix continues on disk (kv_tiers/manager.py)        -> LOADING, out of the queue
    otherwise                                             -> prefix-cache hit, blocks, RUNNING
    no budget or no blocks                                -> put back and stop (strict order)

Pure synchronous code: no trio, no zmq, no torch.
"""

from __future__ import annotations

from trillium.actors.kv_tiers.block_pool import BlockPool, PrefixHit
from trillium.actors.kv_tiers.manager import KvTiers
from trillium.actors.scheduler.config import SchedulerConfig
from trillium.actors.scheduler.grammar_gate import GrammarGate
from trillium.actors.scheduler.metrics import StepEvents
from trillium.actors.scheduler.policy import SiblingGate, SchedulingPolicy
from trillium.actors.scheduler.preemption import Preemption
from trillium.actors.scheduler.request import Request, RequestStatus
from trillium.actors.scheduler.step_plan import StepPlan


class Admission:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, policy: SchedulingPolicy, siblings: SiblingGate,
                 preemption: Preemption, kv_tiers: KvTiers, events: StepEvents,
                 grammars: GrammarGate | None = None) -> None:
        self.config = config
        self.pool = pool
        self.policy = policy
        self.siblings = siblings
        self.preemption = preemption
        self.kv_tiers = kv_tiers
        self.events = events
        self.grammars = grammars if grammars is not None else GrammarGate()
        # Draining (scheduler/engine_state.py): admit only requests that ran before.
        self.started_only = False

    def admit_waiting(self, plan: StepPlan, running: list[Request]) -> None:
        """Admit waiting requests into `plan` (and `running`); see the module docstring."""
        put_back: list[Request] = []
        while len(self.policy) and len(running) < self.config.max_num_seqs and plan.token_budget > 0:
            request = self.policy.pop()
            if self.siblings.must_wait(request) or (self.started_only and not request.known_to_executor):
                put_back.append(request)
                continue
            if not self._lora_fits(request, running):
                # WHY skip, not stop: its adapter needs a slot; requests for resident
                # adapters (or the base model) may go first, as vLLM does.
                put_back.append(request)
                continue
            if not self.grammars.ready(request):
                # WHY skip, not stop: its grammar compiles off the step's path;
                # the requests behind it must not wait for it.
                put_back.append(request)
                continue
            if self.preemption.is_swapped(request):
                admitted = self._admit_swapped(request, plan, running)
            else:
                hit = self.pool.get_computed_blocks(request)  # one lookup serves both below
                if self.kv_tiers.start_loading(request, hit, self.events.clock()):
                    continue  # LOADING: out of the queue until its disk reads are back
                admitted = self._admit(request, hit, plan, running)
            if not admitted:
                put_back.append(request)
                break  # WHY: strict order; a later, smaller request must not starve this one
        self.policy.push_front(put_back)

    def lora_state(self, running: list[Request]) -> dict:
        """SchedulerStats' LoRA fields; nothing to scan when LoRA is off (every step calls stats)."""
        if not self.config.max_loras:
            return {}
        return dict(
            running_lora_ids=tuple(sorted({r.lora_id for r in running if r.lora_id})),
            waiting_lora_ids=tuple(sorted({r.lora_id for r in self.policy if r.lora_id})),
            max_loras=self.config.max_loras,
        )

    def _lora_fits(self, request: Request, running: list[Request]) -> bool:
        """Admitting `request` keeps the running adapters within the device slots."""
        if not request.lora_id:
            return True
        active = {r.lora_id for r in running if r.lora_id}
        return request.lora_id in active or len(active) < self.config.max_loras

    def _admit_swapped(self, request: Request, plan: StepPlan, running: list[Request]) -> bool:
        """Re-admit a swapped-out request: fresh blocks for its KV and the new
        tokens, its KV loaded back into them; no prefix-cache lookup."""
        num = self.config.num_new_tokens(request.num_tokens, request.num_computed_tokens, plan.token_budget)
        if num <= 0:
            return False
        new_blocks = self.preemption.swap_in(request, self.pool, num)
        if new_blocks is None:
            return False
        self._run(request, plan, running, num, new_blocks)
        return True

    def _admit(self, request: Request, hit: PrefixHit, plan: StepPlan, running: list[Request]) -> bool:
        """Admit a waiting request after its prefix-cache `hit`; False if it must wait."""
        num = self.config.num_new_tokens(request.num_tokens, hit.num_computed_tokens, plan.token_budget)
        if num <= 0:
            return False
        new_blocks = self.pool.allocate_slots(request, num, hit)
        if new_blocks is None:
            return False
        request.num_computed_tokens = hit.num_computed_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = hit.num_computed_tokens
        self.kv_tiers.admitted(request)
        self.events.scheduled(request.times)
        self._run(request, plan, running, num, new_blocks)
        return True

    def _run(self, request: Request, plan: StepPlan, running: list[Request], num: int, new_blocks) -> None:
        request.set_status(RequestStatus.RUNNING)
        running.append(request)
        self.siblings.admitted(request)
        plan.add(request, num, new_blocks, is_new=True)
