"""Executor core: model weights, the paged KV cache, forward and sampling.

Consumes `ExecuteBatch`, produces `BatchResult` (protocol/execute.py).
Owns: the model, one (k_cache, v_cache) pair per layer, and per-request
state (token ids, block table, sampling state with its generator).

The idea of one step: every scheduled request contributes
`num_scheduled_tokens` tokens starting at its `num_computed_tokens`; they are
laid flat (no padding) with their positions and cache slots, the model runs
once, and the requests whose scheduled tokens reach the end of their known
tokens are sampled from their last row. A sampled token is appended to the
executor's own copy of the request's tokens, so the next step needs only
the token count from the scheduler (send once, then diffs).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import attrs
import numpy as np
import torch

from trillium.actors.executor.compiled_decode import build_forward
from trillium.actors.executor.grammar import GrammarCompiler
from trillium.actors.executor.kv_stores import KvStores
from trillium.actors.executor.pooler import POOLED_TOKEN_ID, PoolingHead
from trillium.actors.executor.profiling import StageClock
from trillium.actors.executor.sampler import SamplingState, compute_prompt_logprobs, sample
from trillium.actors.protocol.execute import (
    AheadTokens,
    BatchResult,
    ExecuteBatch,
    NewRequestData,
    PromptLogprobs,
    TokenLogprobs,
)
from trillium.config import EngineConfig
from trillium.kernels import AttentionMetadata
from trillium.kernels.metadata import DecodeRun
from trillium.speculative.proposer import AdaptiveDepth, DraftCosts, build_proposer, drafts_left
from trillium.speculative.verify import DraftRun, verify_drafts

log = logging.getLogger(__name__)

# How long a transfer-only step waits for a disk read to finish (bounds the
# idle poll rate while only loading requests are left; a finished read ends it).
_TRANSFER_WAIT_S = 0.05

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@attrs.define
class RequestState:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingState
    lora_id: int = 0
    # Speculative decoding: drafts proposed for the next step, and this request's depth.
    draft_token_ids: list[int] = attrs.Factory(list)
    depth: AdaptiveDepth | None = None
    stop_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) and stop token ids: end a draft run
    eagle_kv: object | None = None  # the eagle head's KV of this request (speculative/eagle.py HeadKv)
    # Multi-step decode: its run ended at a stop token id, which finishes it in the scheduler. WHY kept:
    # with async scheduling the next step was planned with the run's every forward, so its rows would
    # read tokens and blocks this state does not have; execute() leaves it out until it is dropped.
    ended: bool = False


class ExecutorCore:
    """One executor rank. Tensor parallel (`tp_rank` of `config.tensor_parallel_size`):
    this rank's shard of the weights and KV cache (`models/tensor_parallel.py`); rank 0
    alone samples, the others take its tokens through `apply_sampled` (tp_fanout.py)."""

    def __init__(self, config: EngineConfig, tp_rank: int = 0, link_key=None) -> None:
        """`link_key`: the deployment's secret, which every TP rank proves to the others
        (distributed/nodes.py); None only for a core a test builds without a deployment."""
        from trillium.distributed.nodes import config_fingerprint, local_rank
        from trillium.distributed.tp_group import NO_TP, TpGroup
        from trillium.models.llama import allocate_kv_caches
        from trillium.models.loader import load_model

        self.config = config
        size = config.tensor_parallel_size
        # More than one host: device index and cores count the ranks on this host only.
        on_host = size // config.tp_nnodes
        self.device = _rank_device(config.device, local_rank(tp_rank, size, config.tp_nnodes), size)
        self.dtype = _DTYPES[config.dtype]
        threads = config.num_threads or (_rank_threads(on_host) if size > 1 else 0)
        if threads:
            torch.set_num_threads(threads)
        # vLLM's --seed: requests without their own seed draw from the default generator.
        torch.manual_seed(config.seed)
        membership = None if link_key is None else (link_key, config_fingerprint(config))
        self.tp = NO_TP if size == 1 else TpGroup.join(
            tp_rank, size, config.tp_master_port, self.device, config.tp_collective_timeout_s,
            master_addr=config.tp_master_addr, membership=membership)
        # Rank 0 samples; the others keep the states it sampled for, until its tokens come.
        self.last_sampled = np.zeros(0, np.int32)
        self._awaiting_tokens: list[RequestState] = []
        self.model, self.model_config = load_model(
            config.model, dtype=config.dtype, device=self.device, max_positions=config.max_model_len,
            runner=config.runner,
            gguf_dequantize=config.gguf_dequantize, gguf_activations=config.gguf_activations or "int8",
            tp=self.tp,
        )
        self.model.eval()
        # Compiled decode at batch-size buckets, or the eager forward (executor/compiled_decode.py).
        self.forward = build_forward(config, self.model)
        # A pooling model answers with pooled outputs where a generator samples (executor/pooler.py).
        self.pooler = PoolingHead.build(config, self.model)
        self.kv_cache_dtype = config.kv_cache_dtype if config.kv_cache_dtype != "auto" else config.dtype
        # Tensor parallel: this rank's KV heads only (same blocks, same ids on every rank).
        self.kv_caches = allocate_kv_caches(
            self.model.local_config, config.num_blocks, config.block_size, self.kv_cache_dtype, self.device
        )
        # The host and disk KV tiers' memory and files (executor/kv_stores.py); empty when off.
        self.kv_stores = KvStores.build(config, self.kv_caches, self.device, self.tp)
        self.requests: dict[str, RequestState] = {}
        self.stages = StageClock()  # a step's stages as timeline spans; a no-op unless one runs
        # Speculative decoding (trillium/speculative/): proposes after sampling; None when off.
        self.proposer = build_proposer(config.speculative_config, model=self.model, engine_config=config,
                                       device=self.device)
        # A model proposer (draft_model) keeps a cache per request, freed with the request's blocks.
        self._release_drafts = getattr(self.proposer, "release", None)
        self.draft_costs = DraftCosts()  # what one more draft costs: sets each request's depth
        self.num_speculative_tokens = config.speculative_config.num_speculative_tokens
        # Multi-step decode (scheduler/multi_step.py): a request's draft positions are forwards to run.
        self.multi_step = config.num_scheduler_steps > 1
        # Its inner forwards of argmax-only rows as native greedy runs (_greedy_run);
        # TRILLIUM_NATIVE_GREEDY=0: off (A/B)
        self.native_greedy = os.environ.get("TRILLIUM_NATIVE_GREEDY", "1") != "0"
        # Where each inner forward's tokens go while the step runs (the actor's AheadTokens sender,
        # called on this thread); None: they come with the BatchResult only.
        self.on_ahead_tokens: Callable[[AheadTokens], None] | None = None
        # Structured outputs: compiles on its own threads (executor/grammar.py).
        self.grammars = GrammarCompiler(config.model, self.model_config.vocab_size)
        self.lora = None
        if config.enable_lora:
            from trillium.lora.manager import LoRAManager

            self.lora = LoRAManager(self.model_config, config.max_loras, config.max_lora_rank,
                                    config.max_cpu_loras, self.dtype, self.device, tp_shard=self.model.tp)
        self.tp.barrier()  # WHY: rank 0 is ready (and steps come) only once every rank has loaded
        log.info(
            "executor ready: %s (%s), KV cache %d blocks x %d tokens (%s)",
            config.model, config.dtype, config.num_blocks, config.block_size, self.kv_cache_dtype,
        )

    def close(self) -> None:
        """Finish the disk tier's queued writes (a restart reads them)."""
        self.grammars.close()
        self.kv_stores.close()
        self.tp.close()

    def apply_sampled(self, tokens: np.ndarray) -> None:
        """A rank past the first: rank 0's tokens of the steps since the last fan-out, in its order."""
        states, self._awaiting_tokens = self._awaiting_tokens, []
        if len(states) != len(tokens):
            raise RuntimeError(f"tensor-parallel ranks out of step: {len(tokens)} tokens for {len(states)} rows")
        for state, token in zip(states, tokens.tolist()):
            state.token_ids.append(token)

    # -- state updates -------------------------------------------------

    def _add(self, new: NewRequestData) -> RequestState:
        old = self.requests.get(new.request_id)
        # A resumed (preempted) request keeps its sampling state, so a seeded
        # request continues the same random stream and its grammar matcher
        # keeps its place.
        constraint = new.sampling.structured_outputs
        sampling = old.sampling if old is not None else SamplingState(
            new.sampling,
            new.token_ids[: new.num_prompt_tokens].tolist(),
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=new.eos_token_ids,
            output_token_ids=new.token_ids[new.num_prompt_tokens :].tolist(),
            device=self.device,
            grammar=None if constraint is None or not self.tp.is_first
            else self.grammars.constraint(constraint, new.eos_token_ids),
        )
        state = RequestState(
            request_id=new.request_id,
            token_ids=new.token_ids.tolist(),
            num_prompt_tokens=new.num_prompt_tokens,
            block_ids=new.block_ids.tolist(),
            num_computed_tokens=new.num_computed_tokens,
            sampling=sampling,
            lora_id=new.lora_id,
            depth=None if old is None else old.depth,
            stop_ids=frozenset((*new.sampling.stop_token_ids, *(() if new.sampling.ignore_eos else new.eos_token_ids))),
        )
        self.requests[new.request_id] = state
        return state

    def _apply_diffs(self, batch: ExecuteBatch) -> list[RequestState]:
        for rid in batch.finished_request_ids:
            self.requests.pop(rid, None)
        if self.pooler is not None:
            self.pooler.drop(batch.finished_request_ids)
        if self._release_drafts is not None:
            self._release_drafts((*batch.finished_request_ids, *batch.preempted_request_ids))
        for rid in batch.preempted_request_ids:
            state = self.requests.get(rid)
            if state is not None:
                state.block_ids = []
                state.draft_token_ids = []
                state.eagle_kv = None
        order = [self._add(new) for new in batch.new_requests]
        cached = batch.cached
        offsets = cached.new_block_offsets
        new_blocks = cached.new_block_ids
        # NOTE: with a sliding window the scheduler frees a running request's blocks behind it
        # without saying so; their ids stay here, unread and unwritten (kv_tiers/sliding_window.py).
        for i, rid in enumerate(cached.request_ids):
            state = self.requests[rid]
            lo, hi = int(offsets[i]), int(offsets[i + 1])
            if hi > lo:
                state.block_ids.extend(new_blocks[lo:hi].tolist())
            state.num_computed_tokens = int(cached.num_computed_tokens[i])
            order.append(state)
        return order

    # -- one step ------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: ExecuteBatch) -> BatchResult:
        start = time.perf_counter()
        self.stages.begin()
        host_load_s = self.kv_stores.apply(self.kv_caches, batch.kv)  # before anything writes the cache
        if self.tp.is_first:  # WHY: the other ranks never sample, so never constrain
            self.grammars.submit(batch.compile_grammars)
        states = self._apply_diffs(batch)
        counts = batch.num_scheduled_tokens.tolist()
        num_drafts = batch.num_draft_tokens.tolist() if len(batch.num_draft_tokens) else [0] * len(counts)
        if any(s.ended for s in states):  # finished by a step before (RequestState.ended): no rows, no token
            keep = [i for i, s in enumerate(states) if not s.ended]
            states, counts = [states[i] for i in keep], [counts[i] for i in keep]
            num_drafts = [num_drafts[i] for i in keep]
            if not states:
                return BatchResult(step_id=batch.step_id, request_ids=(), sampled_token_ids=np.zeros(0, np.int32),
                                   execute_time_s=time.perf_counter() - start, kv_host_load_s=host_load_s,
                                   **self.kv_stores.completions(), **self.grammars.completions())
        if not states:
            return self._transfer_only(batch, start)
        runs: list[tuple[RequestState, DraftRun, int]] = []  # speculative: verified, not sampled
        input_ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_states: list[RequestState] = []
        sample_index: list[int] = []  # position of each sampled request in the batch
        prompt_lp: list[tuple[RequestState, int, int]] = []  # state, first row, num rows
        row = 0
        first_rows: list[int] = []  # each state's first row of `hidden` (a hidden-state proposer reads them)
        ahead: list[tuple[RequestState, int, int]] = []  # multi-step decode: (state, index, forwards after this one)
        if self.multi_step and any(num_drafts):
            for index, d in enumerate(num_drafts):
                if d:  # the first forward computes its known token; _run_ahead the rest
                    ahead.append((states[index], index, d))
                    counts[index] -= d
                    num_drafts[index] = 0
        if ahead and self._greedy_from_first(states, counts, ahead):
            # every row a decode of argmax-only rows: the step's first forward joins its native greedy runs
            sampled, logprobs = np.full(len(states), -1, dtype=np.int32), {}
            self.stages.mark("inputs")
            spec = self._run_ahead(batch.step_id, ahead, logprobs, first=sampled)
            self.stages.mark("sample")
            return BatchResult(
                step_id=batch.step_id, request_ids=tuple(s.request_id for s in states), sampled_token_ids=sampled,
                logprobs=logprobs, execute_time_s=time.perf_counter() - start, kv_host_load_s=host_load_s,
                **self.kv_stores.completions(), **self.grammars.completions(), **spec,
            )
        for index, (state, n, d) in enumerate(zip(states, counts, num_drafts)):
            first_rows.append(row)
            begin = state.num_computed_tokens
            end = begin + n
            input_ids.extend(state.token_ids[begin : end - d])
            if d:  # the drafts follow the known tokens: scored in the same forward
                input_ids.extend(state.draft_token_ids[:d])
            positions.extend(range(begin, end))
            seq_lens.append(end)
            if state.sampling.params.prompt_logprobs is not None and begin < state.num_prompt_tokens - 1:
                prompt_lp.append((state, row, min(end, state.num_prompt_tokens - 1) - begin))
            row += n
            if d:
                runs.append((state, DraftRun(state.sampling, state.draft_token_ids[:d], row - d - 1,
                                             state.stop_ids), index))
            elif end >= len(state.token_ids):
                sample_rows.append(row - 1)
                sample_states.append(state)
                sample_index.append(index)
        meta = AttentionMetadata.build(
            counts, seq_lens, [s.block_ids for s in states], self.config.block_size, self.device,
            verify_rows=bool(runs),  # drafts' rows may attend as decode rows (kernels/paged_attention_cpu.py)
        )
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        lora, swap_ins = None, 0
        if self.lora is not None:
            before = self.lora.num_swap_ins
            lora = self.lora.batch([s.lora_id for s in states], counts)
            swap_ins = self.lora.num_swap_ins - before
        self.stages.mark("inputs")
        hidden = self.forward(ids_t, pos_t, self.kv_caches, meta, lora=lora)
        self.stages.mark("forward")  # NOTE: on CUDA the launch only; the sync lands in "sample"

        sampled = np.full(len(states), -1, dtype=np.int32)
        logprobs: dict[str, TokenLogprobs] = {}
        pooled = {}
        if self.pooler is not None:
            self.pooler.observe(hidden, states, counts)
            if sample_rows:
                pooled = self._pool(hidden, sample_rows, sample_states, sample_index, sampled)
        elif sample_rows:
            if len(sample_rows) == hidden.shape[0]:
                last = hidden  # rows ascend and are distinct: every row, in order (pure decode)
            else:
                last = hidden.index_select(0, torch.tensor(sample_rows, dtype=torch.int64, device=self.device))
            logits = self.model.compute_logits(last)
            if logits is None:  # a rank past the first: rank 0 samples; its tokens come with the next fan-out
                self._awaiting_tokens.extend(sample_states)
            else:
                self._sample(logits, sample_states, sample_index, sampled, logprobs)
        spec = self._verify(hidden, runs, sampled, logprobs) if runs else {}
        if ahead:
            spec = self._run_ahead(batch.step_id, ahead, logprobs)
        if self.proposer is not None and self.pooler is None:
            if all(n - d == 1 for n, d in zip(counts, num_drafts)):  # a decode step: what drafts cost
                self.draft_costs.observe_step(time.perf_counter() - start, sum(num_drafts))
            spec["proposed_drafts"] = self._propose([*sample_states, *(r[0] for r in runs)],
                                                    hidden, list(zip(states, first_rows, counts)),
                                                    batch.propose_drafts)
        self.stages.mark("sample")
        prompt_results = tuple(r for r in (self._prompt_logprobs(hidden, item) for item in prompt_lp) if r is not None)
        fetched = self.kv_stores.completions()
        self.stages.mark("result")
        return BatchResult(
            step_id=batch.step_id,
            request_ids=tuple(s.request_id for s in states),
            sampled_token_ids=sampled,
            logprobs=logprobs,
            **pooled,
            prompt_logprobs=prompt_results,
            execute_time_s=time.perf_counter() - start,
            lora_swap_ins=swap_ins,
            kv_host_load_s=host_load_s,
            **fetched,
            **self.grammars.completions(),
            **spec,
        )

    def _sample(self, logits, states: list[RequestState], indices: list[int], sampled: np.ndarray,
                logprobs: dict[str, TokenLogprobs]) -> None:
        out = sample(logits, [s.sampling for s in states])
        tokens = out.token_ids.tolist()
        if self.tp.size > 1:  # the other ranks' copies get them with the next fan-out (tp_fanout.py)
            self.last_sampled = np.concatenate([self.last_sampled, np.asarray(tokens, dtype=np.int32)])
        # One host copy per column, not per row.
        rows_lp = out.logprobs.to_token_logprobs() if out.logprobs is not None else None
        for j, (state, token, index) in enumerate(zip(states, tokens, indices)):
            state.token_ids.append(token)
            state.sampling.append(token)
            sampled[index] = token
            if rows_lp is not None and rows_lp[j] is not None:
                logprobs[state.request_id] = rows_lp[j]

    def _verify(self, hidden, runs, sampled: np.ndarray, logprobs: dict) -> dict:
        """Speculative requests: score every draft position, accept a prefix exactly
        (speculative/verify.py), keep the emitted tokens; the BatchResult fields."""
        rows = [run.first_row + j for _, run, _ in runs for j in range(len(run.drafts) + 1)]
        logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(rows, device=self.device)))
        offset = 0
        for _, run, _ in runs:  # rows of the compacted logits
            run.first_row, offset = offset, offset + len(run.drafts) + 1
        verify_drafts(logits, [run for _, run, _ in runs])
        more, more_lp, accepted = {}, {}, {}
        for state, run, index in runs:
            rid = state.request_id
            state.token_ids.extend(run.tokens)
            sampled[index] = run.tokens[0]
            more[rid] = tuple(run.tokens[1:])
            accepted[rid] = run.num_accepted
            if run.logprobs:
                logprobs[rid] = run.logprobs[0]
                more_lp[rid] = tuple(run.logprobs[1:])
            state.depth.observe(len(run.drafts), run.num_accepted)
            self._trim_past_valid_kv(state)  # rollback
        return {"more_token_ids": more, "more_logprobs": more_lp, "num_accepted_drafts": accepted}

    def _trim_past_valid_kv(self, state: RequestState) -> None:
        """After a step that emitted several tokens (verified drafts, multi-step forwards): KV is
        valid for every token but the last, so drop the blocks past it; the scheduler frees the
        same blocks (Scheduler._take_tokens, BlockPool.trim, for drafts; a multi-step run keeps them
        all, then this drops none, or it ended at a stop id and the request finishes)."""
        keep = -(-(len(state.token_ids) - 1) // self.config.block_size)
        del state.block_ids[keep:]

    def _run_ahead(self, step_id: int, ahead: list[tuple[RequestState, int, int]], logprobs: dict,
                   first: np.ndarray | None = None) -> dict:
        """Multi-step decode (scheduler/multi_step.py): after the step's forward sampled each of
        these requests, run up to d more decode forwards for it, each feeding the token the one
        before it sampled, sampled as a decode step is; a request's run ends after an EOS or stop
        token id once min_tokens is reached (`_stopped`). Before every --stream-interval'th forward,
        the tokens sampled since the last such send go to `on_ahead_tokens` (a run's last token
        never does: it may finish the request). The BatchResult fields: the tokens after the first, their logprobs.
        `first` (the batch's sampled tokens, a row per request of `ahead` at its index): the step's
        first forward runs here too, as forward 0 (_greedy_from_first), its tokens into `first`."""
        more: dict[str, list[int]] = {s.request_id: [] for s, _, _ in ahead}
        more_lp: dict[str, list[TokenLogprobs]] = {}
        alive = [(state, d) for state, _, d in ahead]
        index_of = {s.request_id: index for s, index, _ in ahead}
        j0 = 0 if first is not None else 1  # the first forward of the loop
        # Every request runs at least `shared` more forwards unless it stops: their metadata at once.
        shared = min(d for _, d in alive) + 1 - j0
        run = DecodeRun.build([len(s.token_ids) for s, _ in alive], [s.block_ids for s, _ in alive],
                              self.config.block_size, shared, self.device)
        interval = self.config.stream_interval
        j, last = j0, max(d for _, d in alive)
        while j <= last:
            alive = [(s, d) for s, d in alive if d >= j and (j == 0 or not _stopped(s))]
            if not alive:
                break
            states = [s for s, _ in alive]
            if self.on_ahead_tokens is not None and j and j % interval == 0:
                self.on_ahead_tokens(self._ahead_tokens(step_id, states, interval, logprobs, more_lp))
            # Forwards j .. j + span - 1: every row runs them all, no ahead tokens go out between them.
            span = min(min(d for _, d in alive) - j + 1, interval - j % interval)
            steps = run.window(j - j0, span) if len(alive) == len(ahead) and j - j0 + span <= shared else None
            tokens = self._greedy_run(states, steps, span)
            if tokens is None:  # one forward, sampled by the sampler
                meta = steps.first_step() if steps is not None else AttentionMetadata.build(
                    [1] * len(states), [len(s.token_ids) for s in states], [s.block_ids for s in states],
                    self.config.block_size, self.device)
                ids_t = torch.tensor([s.token_ids[-1] for s in states], dtype=torch.int64, device=self.device)
                pos_t = torch.tensor([len(s.token_ids) - 1 for s in states], dtype=torch.int64, device=self.device)
                lora = self.lora.batch([s.lora_id for s in states], [1] * len(states)) if self.lora is not None else None
                hidden = self.forward(ids_t, pos_t, self.kv_caches, meta, lora=lora)
                row, rows_lp = np.full(len(states), -1, dtype=np.int32), {}
                self._sample(self.model.compute_logits(hidden), states, list(range(len(states))), row, rows_lp)
                tokens = row[None, :]
                for state in states:
                    if state.request_id in rows_lp:
                        if j:
                            more_lp.setdefault(state.request_id, []).append(rows_lp[state.request_id])
                        else:
                            logprobs[state.request_id] = rows_lp[state.request_id]
            else:
                for state, column in zip(states, tokens.T.tolist()):
                    state.token_ids.extend(column)
                    state.sampling.extend(column)
            for state, column in zip(states, tokens.T.tolist()):
                if j == 0:  # the step's own token, then the run's
                    first[index_of[state.request_id]], column = column[0], column[1:]
                more[state.request_id].extend(column)
            j += len(tokens)
        for state, _, _ in ahead:
            self._trim_past_valid_kv(state)  # as after a verification
            state.ended = _stopped(state)
        return {"more_token_ids": {rid: tuple(tokens) for rid, tokens in more.items()},
                "more_logprobs": {rid: tuple(entries) for rid, entries in more_lp.items()}}

    def _greedy_from_first(self, states: list[RequestState], counts: list[int], ahead: list) -> bool:
        """Can the step's first forward join the native greedy runs (`_run_ahead(first=...)`)? Every
        row runs ahead and is one decode token (its known tokens computed but the last), nothing else
        reads the forward's hidden states (a pooler, a draft proposer), and the rows are what
        `_greedy_run` takes (argmax-only, no LoRA). WHY: its own forward, the LM head and the
        sampler in Python cost a one-stream multi-step step ~1-2 ms beside its 16 native forwards."""
        return (len(ahead) == len(states) and self.pooler is None and self.proposer is None
                and all(n == 1 and s.num_computed_tokens == len(s.token_ids) - 1 for s, n in zip(states, counts))
                and self._greedy_takes(states))

    def _greedy_takes(self, states: list[RequestState]) -> bool:
        return (self.native_greedy and self.tp.size == 1 and len(states) <= self.forward.greedy_rows
                and all(s.sampling.argmax_only and not s.lora_id for s in states))

    def _greedy_run(self, states: list[RequestState], steps: DecodeRun | None, span: int) -> np.ndarray | None:
        """Multi-step decode's next `span` forwards of `states` in one native call (CompiledDecode.greedy_run:
        the forwards, the LM head and the argmax in C++), where the sampler would take every row's argmax
        of its raw logits (SamplingState.argmax_only) and no row has a LoRA adapter: the tokens
        [m, rows], m <= span (fewer when a row sampled a stop id); None: not taken, nothing run.
        `steps`: the forwards' metadata built ahead, None to build it here."""
        if not self._greedy_takes(states):
            return None
        if steps is None:
            steps = DecodeRun.build([len(s.token_ids) for s in states], [s.block_ids for s in states],
                                    self.config.block_size, span, self.device)
        return self.forward.greedy_run([s.token_ids[-1] for s in states], steps, self.kv_caches,
                                       [s.stop_ids for s in states])

    @staticmethod
    def _ahead_tokens(step_id: int, states: list[RequestState], count: int, first_logprobs: dict,
                      more_logprobs: dict) -> AheadTokens:
        """Each state's last `count` tokens (all of them before the next inner forward's input
        and after the last AheadTokens), with their logprobs: the step's first forward's in
        `first_logprobs` (one entry per request), the inner forwards' in `more_logprobs` (lists)."""
        entries = {}
        for s in states:
            rid = s.request_id
            if rid in first_logprobs:
                run = [first_logprobs[rid], *more_logprobs.get(rid, ())]  # the run's tokens so far
                entries[rid] = tuple(run[-count:])
        tokens = np.array([s.token_ids[-count:] for s in states], dtype=np.int32).reshape(len(states), count)
        return AheadTokens(step_id=step_id, request_ids=tuple(s.request_id for s in states), token_ids=tokens,
                           logprobs=entries)

    def _propose(self, states: list[RequestState], hidden, step_rows: list, wanted_next: bool) -> dict[str, int]:
        """Drafts for each request just sampled, kept for its next step; their counts.
        A hidden-state proposer (eagle) sees the whole step at once: `step_rows`, every
        scheduled (state, first row, rows), so its own cache follows prefill chunks too.
        A batch proposer (draft_model) drafts for every drafting request in one call.
        Depths are capped by what max_tokens / max_model_len leave (drafts_left).
        Not `wanted_next` (disable_by_batch_size): every depth is 0, so no lookup and no
        draft forward; eagle still defers the step's rows into its cache, the draft model
        catches up on the tokens it missed at its next proposal (draft_model.py)."""
        depths = {}
        cost = self.draft_costs.relative()
        for state in states:
            if not state.sampling.params.speculative:
                continue  # the request opted out (SamplingParams.speculative)
            if state.depth is None:
                state.depth = AdaptiveDepth(self.num_speculative_tokens)
            if not wanted_next:
                depths[state.request_id] = 0  # the adaptive depth is not stepped: no drafts to judge
                continue
            left = drafts_left(state.sampling.params.max_tokens, len(state.token_ids), state.num_prompt_tokens,
                               self.config.max_model_len)
            depths[state.request_id] = max(0, min(state.depth.next_depth(cost), left))
        start = time.perf_counter()
        if getattr(self.proposer, "reads_hidden_states", False):
            rows = [(s, first, n, depths.get(s.request_id, 0)) for s, first, n in step_rows
                    if s.sampling.params.speculative]
            drafts = self.proposer.propose_from_hidden(hidden, rows)
        elif hasattr(self.proposer, "propose_batch"):  # a model: one forward per position for all
            wanted = [s for s in states if depths.get(s.request_id)]
            batch = self.proposer.propose_batch(wanted, [depths[s.request_id] for s in wanted])
            drafts = {s.request_id: draft for s, draft in zip(wanted, batch)}
        else:
            drafts = {s.request_id: self.proposer.propose(s.token_ids, depths[s.request_id])
                      for s in states if depths.get(s.request_id)}
        self.draft_costs.observe_proposal(time.perf_counter() - start, max(depths.values(), default=0))
        counts = {}
        for state in states:
            if state.request_id in depths:
                state.draft_token_ids = drafts.get(state.request_id, [])
                if state.draft_token_ids:
                    counts[state.request_id] = len(state.draft_token_ids)
        return counts

    def _pool(self, hidden, rows, states, indices, sampled: np.ndarray) -> dict:
        """BatchResult fields of the requests whose prompts are done: their pooled outputs."""
        fields = self.pooler.result_fields(hidden, rows, states)
        for state, index in zip(states, indices):
            state.token_ids.append(POOLED_TOKEN_ID)  # INVARIANT: the executor knows the scheduler's tokens
            sampled[index] = POOLED_TOKEN_ID
        return {"pooled_request_ids": tuple(s.request_id for s in states), **fields}

    def _transfer_only(self, batch: ExecuteBatch, start: float) -> BatchResult:
        """A batch with no requests: the scheduler only waits for disk reads
        or grammar compiles (every runnable request is loading or waits for its
        grammar). Wait a little for one to finish, rather than spin through
        empty steps."""
        grammar_wait_s = _TRANSFER_WAIT_S if self.grammars.num_pending else 0.0
        grammars = self.grammars.completions(grammar_wait_s)
        fetched = self.kv_stores.completions(_TRANSFER_WAIT_S - grammar_wait_s)
        return BatchResult(
            step_id=batch.step_id, request_ids=(), sampled_token_ids=np.zeros(0, np.int32),
            execute_time_s=time.perf_counter() - start, **fetched, **grammars,
        )

    def _prompt_logprobs(self, hidden: torch.Tensor, item: tuple[RequestState, int, int]) -> PromptLogprobs | None:
        state, first_row, num_rows = item
        begin = state.num_computed_tokens
        logits = self.model.compute_logits(hidden[first_row : first_row + num_rows])
        if logits is None:  # a rank past the first took part in the gather
            return None
        targets = torch.tensor(state.token_ids[begin + 1 : begin + 1 + num_rows], device=self.device)
        tensors = compute_prompt_logprobs(logits, targets, state.sampling.params.prompt_logprobs)
        entries = tuple(e for e in tensors.to_token_logprobs() if e is not None)
        return PromptLogprobs(request_id=state.request_id, start=begin + 1, entries=entries)


def _stopped(state: RequestState) -> bool:
    """Did the token just sampled end the request (one of its stop token ids, EOS unless ignore_eos,
    with min_tokens reached: the scheduler's Request.check_stop)? A multi-step run ends there."""
    sampling = state.sampling
    return state.token_ids[-1] in state.stop_ids and sampling.num_output_tokens >= sampling.params.min_tokens


def _rank_device(device: str, rank: int, size: int) -> torch.device:
    """Rank r of a tensor-parallel group on CUDA: the r-th device from the one named (cuda:N -> cuda:N+r)."""
    base = torch.device(device)
    if size == 1 or base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def _rank_threads(size: int) -> int:
    """On CPU the ranks split the cores (at least one thread each)."""
    import os

    return max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) // size)
