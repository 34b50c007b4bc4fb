"""One step's plan: which requests compute how many tokens, with which new
blocks, and its translation into the `ExecuteBatch` wire message.

Built and filled by `Scheduler.schedule()`; `to_batch` lays it out in batch
order (requests new to the executor first, then cached ones, columnar):

    num_scheduled_tokens  [ new_0 .. new_k | cached_0 .. cached_m ]
    new_block_ids         [ blocks of cached_0 | blocks of cached_1 | ... ]
    new_block_offsets     [ 0, len0, len0 + len1, ... ]      (m + 1 entries)

plus the host KV tier's copies queued while the step was planned.

Same-step prefix sharing: given the pool, `add` registers at once the blocks
the step fills (`BlockPool.cache_scheduled_blocks`), so a request admitted
after it in this very step finds them (a batch of rerank pairs, of chats with
one system prompt: the shared prefix is computed once); `drop` forgets them.
"""

from __future__ import annotations

import attrs
import numpy as np

from trillium.actors.kv_tiers.block_pool import BlockId, BlockPool
from trillium.actors.protocol.execute import NO_TRANSFERS, CachedRequests, ExecuteBatch, KvTransfers, NewRequestData
from trillium.actors.scheduler.request import Request


@attrs.define
class StepPlan:
    token_budget: int
    new: list[Request] = attrs.Factory(list)  # admitted from waiting this step
    cached: list[Request] = attrs.Factory(list)  # already running
    num_tokens: dict[str, int] = attrs.Factory(dict)
    new_block_ids: dict[str, list[BlockId]] = attrs.Factory(dict)
    preempted: list[str] = attrs.Factory(list)
    num_drafts: dict[str, int] = attrs.Factory(dict)  # speculative: drafts among num_tokens (> 0 only)
    # Set: blocks full of scheduled tokens are registered on `add` (module doc); None: at the step's result only.
    pool: BlockPool | None = None
    shared_blocks: dict[str, list[BlockId]] = attrs.Factory(dict)  # registered by `add`, per request

    def add(self, request: Request, num_tokens: int, new_blocks: list[BlockId], *, is_new: bool,
            num_drafts: int = 0) -> None:
        (self.new if is_new else self.cached).append(request)
        self.num_tokens[request.request_id] = num_tokens
        if num_drafts:
            self.num_drafts[request.request_id] = num_drafts
        self.new_block_ids[request.request_id] = new_blocks
        self.token_budget -= num_tokens
        if self.pool is not None:
            # NOTE: num_computed_tokens is where this step's tokens start (advanced once the batch is sent).
            registered = self.pool.cache_scheduled_blocks(request, request.num_computed_tokens + num_tokens)
            if registered:
                self.shared_blocks[request.request_id] = registered

    def drop(self, request: Request) -> None:
        """Unschedule a running request preempted after it was picked (the
        priority policy may choose one earlier in the running list)."""
        num = self.num_tokens.pop(request.request_id, None)
        if num is not None:
            self.token_budget += num
            self.num_drafts.pop(request.request_id, None)
            self.cached.remove(request)
            del self.new_block_ids[request.request_id]
            # INVARIANT: only running requests are dropped, before admission looks anything up,
            # so no request holds these blocks but this one: their KV will never be written.
            if self.pool is not None:
                self.pool.uncache(self.shared_blocks.pop(request.request_id, ()))

    @property
    def requests(self) -> list[Request]:
        return self.new + self.cached  # batch order

    def to_batch(
        self,
        step_id: int,
        pool: BlockPool,
        finished_request_ids: tuple[str, ...],
        preempted_request_ids: tuple[str, ...],
        transfers: KvTransfers = NO_TRANSFERS,
        compile_grammars: tuple[str, ...] = (),
        propose_drafts: bool = True,
    ) -> ExecuteBatch:
        # Requests are read before the step's progress is added: each
        # num_computed_tokens is where its scheduled tokens start.
        new = tuple(
            NewRequestData(
                request_id=r.request_id,
                token_ids=np.asarray(r.all_token_ids, dtype=np.int32),
                num_prompt_tokens=r.num_prompt_tokens,
                sampling=r.sampling_for_executor,
                eos_token_ids=r.eos_token_ids,
                block_ids=np.asarray(pool.block_ids(r.request_id), dtype=np.int32),
                num_computed_tokens=r.num_computed_tokens,
                lora_id=r.lora_id,
            )
            for r in self.new
        )
        block_lists = [self.new_block_ids[r.request_id] for r in self.cached]
        offsets = np.zeros(len(block_lists) + 1, dtype=np.int32)
        np.cumsum([len(b) for b in block_lists], out=offsets[1:])
        cached = CachedRequests(
            request_ids=tuple(r.request_id for r in self.cached),
            num_computed_tokens=np.asarray([r.num_computed_tokens for r in self.cached], dtype=np.int32),
            new_block_ids=np.asarray([b for blocks in block_lists for b in blocks], dtype=np.int32),
            new_block_offsets=offsets,
        )
        return ExecuteBatch(
            step_id=step_id,
            new_requests=new,
            cached=cached,
            num_scheduled_tokens=np.asarray([self.num_tokens[r.request_id] for r in self.requests], dtype=np.int32),
            finished_request_ids=finished_request_ids,
            preempted_request_ids=preempted_request_ids,
            kv=transfers,
            compile_grammars=compile_grammars,
            num_draft_tokens=np.asarray([self.num_drafts.get(r.request_id, 0) for r in self.requests], dtype=np.int32)
            if self.num_drafts else np.zeros(0, np.int32),
            propose_drafts=propose_drafts,
        )
