"""A fake executor with a simulated KV cache, and the reference generation it must match.

The fake follows the ExecuteBatch contract: every computed position writes a
fingerprint of (LoRA id, all tokens up to it) into its slot, every step
re-reads a request's whole context from its block table, and the sampled
token is a function of the fingerprint it read. A wrong block table, a bad
prefix-cache hit or a block overwritten while shared fails an assertion or
changes the output, which tests compare with `reference` (a generation that
never sees the scheduler). `TieredFakeExecutor` adds host memory and performs
a batch's KV copies (saves, then loads) before the step.

Used by the scheduler core, host/disk tier and swap-preemption tests.
"""

from __future__ import annotations

import numpy as np

from trillium.actors.protocol.execute import BatchResult
from trillium.sampling_params import SamplingParams

VOCAB = 50
EOS = 0
_MOD = 2**61 - 1


def roll(h: int, token: int) -> int:
    return (h * 1_000_003 + token + 7) % _MOD


def model_token(h: int, lora_id: int) -> int:
    return ((h >> 7) + 31 * lora_id) % VOCAB


class SimState:
    def __init__(self, rid, tokens, blocks, computed, lora_id, num_prompt):
        self.rid, self.tokens, self.blocks = rid, tokens, blocks
        self.computed, self.lora_id, self.num_prompt = computed, lora_id, num_prompt
        self._hashes: list[int] = []

    def fingerprint(self, pos: int) -> tuple[int, int]:
        while len(self._hashes) <= pos:
            prev = self._hashes[-1] if self._hashes else 0
            self._hashes.append(roll(prev, self.tokens[len(self._hashes)]))
        return (self.lora_id, self._hashes[pos])

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt


class FakeExecutor:
    def __init__(self, num_blocks: int, block_size: int, token_fn=None, sliding_window: int = 0) -> None:
        self.block_size = block_size
        # > 0: attention reads keys p - W + 1 .. p only, and the table's blocks behind
        # that are someone else's (freed by the scheduler) or NULL_BLOCK: never read or owned.
        self.sliding_window = sliding_window
        self.kv: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
        self.states: dict[str, SimState] = {}
        self.token_fn = token_fn or (lambda state, h: model_token(h, state.lora_id))

    def _first_read(self, computed: int) -> int:
        """The first position the next query (at `computed`) reads."""
        return max(0, computed - self.sliding_window + 1) if self.sliding_window else 0

    def _slot(self, state: SimState, pos: int) -> int:
        return state.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def _apply(self, batch) -> list[SimState]:
        for rid in batch.finished_request_ids:
            del self.states[rid]
        for rid in batch.preempted_request_ids:
            self.states[rid].blocks = []
        order = []
        for new in batch.new_requests:
            old = self.states.get(new.request_id)
            tokens = new.token_ids.tolist()
            if old is not None:  # resumed: must carry every token the executor knows
                assert old.blocks == [] and tokens == old.tokens
            state = SimState(new.request_id, tokens, new.block_ids.tolist(), new.num_computed_tokens,
                             new.lora_id, new.num_prompt_tokens)
            self.states[new.request_id] = state
            order.append(state)
        cached = batch.cached
        for i, rid in enumerate(cached.request_ids):
            state = self.states[rid]
            assert state.blocks, f"{rid} was preempted but scheduled as cached"
            assert state.computed == int(cached.num_computed_tokens[i])
            lo, hi = int(cached.new_block_offsets[i]), int(cached.new_block_offsets[i + 1])
            state.blocks.extend(cached.new_block_ids[lo:hi].tolist())
            order.append(state)
        return order

    def execute(self, batch) -> BatchResult:
        order = self._apply(batch)
        counts = batch.num_scheduled_tokens.tolist()
        owners: dict[int, set[SimState]] = {}
        for state in self.states.values():
            for b in state.blocks[self._first_read(state.computed) // self.block_size :]:
                owners.setdefault(b, set()).add(state)
        for state, num in zip(order, counts):  # writes first, as write_kv_cache does
            assert num > 0 and state.computed + num <= len(state.tokens)
            assert len(state.blocks) * self.block_size >= state.computed + num
            for pos in range(state.computed, state.computed + num):
                slot = self._slot(state, pos)
                # A block another request holds may be written only with the KV that request
                # reads there: same-step prefix sharing (step_plan.py), where this step computes
                # a block a request admitted in the same step found in the cache.
                for other in owners[slot // self.block_size] - {state}:
                    assert (pos < len(other.tokens) and other.blocks[pos // self.block_size] == slot // self.block_size
                            and other.fingerprint(pos) == state.fingerprint(pos)), "wrote into a shared block"
                self.kv[slot] = state.fingerprint(pos)
        sampled = []
        for state, num in zip(order, counts):
            end = state.computed + num
            for pos in range(self._first_read(state.computed), end):  # attention reads the whole context (window)
                assert self.kv[self._slot(state, pos)] == state.fingerprint(pos), (state.rid, pos)
            state.computed = end
            if end == len(state.tokens):
                token = self.token_fn(state, self.kv[self._slot(state, end - 1)][1])
                state.tokens.append(token)
                sampled.append(token)
            else:
                sampled.append(-1)
        return BatchResult(batch.step_id, tuple(s.rid for s in order), np.asarray(sampled, dtype=np.int32))


def reference(prompt, sampling: SamplingParams, eos, lora_id, max_model_len):
    """What the request must produce: (tokens, finish_reason, stop_reason)."""
    h = 0
    for t in prompt:
        h = roll(h, t)
    max_tokens = sampling.max_tokens or max_model_len - len(prompt)
    out: list[int] = []
    while True:
        t = model_token(h, lora_id)
        out.append(t)
        h = roll(h, t)
        if len(out) >= sampling.min_tokens:
            if not sampling.ignore_eos and t in eos:
                return out, "stop", None
            if t in sampling.stop_token_ids:
                return out, "stop", t
        if len(out) >= max_tokens or len(prompt) + len(out) >= max_model_len:
            return out, "length", None


class TieredFakeExecutor(FakeExecutor):
    """FakeExecutor plus host memory; performs a batch's copies first."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        super().__init__(num_blocks, block_size)
        self.host: list = [None] * (num_slots * block_size)

    def execute(self, batch):
        size = self.block_size
        saves = list(zip(batch.kv.save_block_ids.tolist(), batch.kv.save_host_slots.tolist()))
        loads = list(zip(batch.kv.load_host_slots.tolist(), batch.kv.load_block_ids.tolist()))
        assert len({s for _, s in saves}) == len(saves) and len({b for _, b in loads}) == len(loads)
        for block, slot in saves:
            assert self.kv[block * size] is not None, "saved a block that was never computed"
            self.host[slot * size : (slot + 1) * size] = self.kv[block * size : (block + 1) * size]
        for slot, block in loads:
            self.kv[block * size : (block + 1) * size] = self.host[slot * size : (slot + 1) * size]
        return super().execute(batch)
