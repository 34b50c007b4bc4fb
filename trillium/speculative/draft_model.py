"""The `draft_model` proposer: a small model of the target's vocabulary drafts k tokens greedily.

    plan_draft_memory(engine_config, target_config, budget_bytes, target_block_bytes, weights_in_budget)
        -> (num target KV blocks, resolved SpeculativeConfig)       start-up, in EngineConfig.resolve
    DraftModelProposer(engine_config, device)                        executor side, one per executor
        .propose_batch(states, depths) -> drafts per request         after each step's sampling
        .release(request_ids)                                        finished / aborted / preempted

What it is (vLLM's "draft_model", vllm/v1/spec_decode/draft_model.py): the
draft is loaded with Trillium's own loader (models/loader.py) onto the
executor's device and dtype, and proposes for every drafting request of a
step at once: one forward over each request's not-yet-drafted tokens (a
varlen batch, like a prefill chunk; ends at the last real token), then one
single-token forward per further draft position, all requests batched.
Drafts are the draft's argmax: point masses, which is what verify.py's
rejection rule assumes (accept x with probability p(x)), so the output is
exactly the target's (greedy: token for token) whatever the draft says.

Its KV cache is paged, its own (`num_draft_blocks` blocks of the target's
block size and KV dtype) with a private free list here. WHY paged and not a
dense per-request buffer: the model's attention reads paged caches only, and
one block table per request lets every request of a step share one forward.
WHY private and not the target's block ids: the draft writes positions the
scheduler has not allocated yet (its own drafts), and the target's blocks
can be shared through the prefix cache or loaded from a KV tier without
draft KV in them. Sizing (plan_draft_memory): the draft gets as many blocks
as the target plus ceil(k / block_size) + 1 per sequence (its draft tail),
and both come out of the one budget: num_blocks = (budget - tail) //
(target block + draft block); with --gpu-memory-utilization the draft's
weights are subtracted too (the target's already are). With prefix caching
several requests may hold draft copies of one shared target block; when
the pool runs out a request simply gets no drafts until blocks free up.

Per request it keeps the tokens whose KV its cache holds (`fed`). Each
proposal first truncates that to the longest prefix still equal to the
request's tokens (rollback: rejected drafts' positions are overwritten
next time), so verification, preemption (the cache is dropped: release) and
adaptive depth need no other bookkeeping. A target weight update leaves the
draft's weights as they are but drops every request's draft cache (`seqs`),
as any weight update does; the draft's own weights are updated with
`draft_model_only` (speculative/draft_weights.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence

import attrs
import torch

from trillium.kernels import AttentionMetadata

log = logging.getLogger(__name__)


def plan_draft_memory(engine_config, target_config, budget_bytes: int, target_block_bytes: int,
                      weights_in_budget: bool):
    """(target num_blocks, SpeculativeConfig with num_draft_blocks): both KV caches (and, when
    the budget covers weights, the draft's weights) in one budget. ValueError when the draft
    does not share the target's vocabulary or the budget does not hold both caches."""
    from trillium.models.kv_cache import kv_cache_block_bytes
    from trillium.models.loader import load_model_config

    spec = engine_config.speculative_config
    try:
        draft_config = load_model_config(spec.model)
    except (FileNotFoundError, OSError, ValueError) as exc:
        raise ValueError(f"--speculative-config model {spec.model!r}: {exc}") from None
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"--speculative-config model {spec.model!r} has vocab size {draft_config.vocab_size}, "
                         f"the target {engine_config.model!r} has {target_config.vocab_size}: a draft model "
                         "must share the target's tokenizer and vocabulary")
    if spec.token_map_ids and max(spec.token_map_ids) >= draft_config.vocab_size:
        raise ValueError(f"--speculative-config token_map {spec.token_map!r} holds token id "
                         f"{max(spec.token_map_ids)}, past the draft's vocabulary of {draft_config.vocab_size}")
    block_size = engine_config.block_size
    kv_dtype = engine_config.kv_cache_dtype
    draft_block_bytes = kv_cache_block_bytes(draft_config, block_size, kv_dtype)
    tail_blocks = engine_config.max_num_seqs * (math.ceil(spec.num_speculative_tokens / block_size) + 1)
    if engine_config.num_blocks:  # given outright (tests): the draft mirrors it
        num_blocks = engine_config.num_blocks
    else:
        if weights_in_budget:
            from trillium.gpu_memory import checkpoint_numel

            element_bytes = torch.empty((), dtype=_torch_dtype(engine_config.dtype)).element_size()
            budget_bytes -= checkpoint_numel(spec.model) * element_bytes
        num_blocks = (budget_bytes - tail_blocks * draft_block_bytes) // (target_block_bytes + draft_block_bytes)
        if num_blocks < 2:
            raise ValueError(f"the KV budget ({budget_bytes} bytes after the draft's weights) does not hold two "
                             f"target blocks ({target_block_bytes} bytes) beside the draft's cache "
                             f"({draft_block_bytes} bytes a block, {tail_blocks} tail blocks)")
    log.info("draft model %s: %d KV blocks of %d bytes beside the target's %d of %d bytes",
             spec.model, num_blocks + tail_blocks, draft_block_bytes, num_blocks, target_block_bytes)
    return int(num_blocks), attrs.evolve(spec, num_draft_blocks=int(num_blocks + tail_blocks))


def _torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


@attrs.define
class _DraftSeq:
    """One request's draft cache: its blocks and the tokens whose KV they hold (positions 0..)."""

    block_ids: list[int] = attrs.Factory(list)
    fed: list[int] = attrs.Factory(list)
    num_real: int = 0  # fed[:num_real] are the request's own tokens (never change)


class DraftModelProposer:
    """See the module docstring. Runs on the executor's torch thread."""

    def __init__(self, engine_config, device: torch.device) -> None:
        from trillium.actors.executor.compiled_decode import build_forward
        from trillium.models.kv_cache import allocate_kv_caches
        from trillium.models.loader import load_model

        spec = engine_config.speculative_config
        if spec.num_draft_blocks < 1:
            raise ValueError("draft_model: num_draft_blocks is resolved by EngineConfig.resolve; resolve first")
        self.block_size = engine_config.block_size
        self.device = device
        self.model, self.model_config = load_model(
            spec.model, dtype=engine_config.dtype, device=device, progress=False,
            gguf_activations=engine_config.gguf_activations or "int8",
            max_positions=engine_config.max_model_len + spec.num_speculative_tokens)
        self.forward = build_forward(engine_config, self.model)  # compiled decode for its 1-token steps
        self.kv_caches = allocate_kv_caches(self.model.local_config, spec.num_draft_blocks, self.block_size,
                                            engine_config.kv_cache_dtype, device)
        self._free: list[int] = list(range(spec.num_draft_blocks - 1, -1, -1))
        self.seqs: dict[str, _DraftSeq] = {}
        # token_map (config.py): the hot ids and the LM head cut to their rows, built now (a head it
        # cannot cut is refused at start-up), dropped whenever the draft's weights may have changed
        # (weights_changed, sleep) and rebuilt at the next use
        self.token_map = (torch.tensor(spec.token_map_ids, dtype=torch.int64, device=device)
                          if spec.token_map_ids else None)
        self._hot_head = None if self.token_map is None else hot_head(self.model, self.token_map)
        log.info("draft model %s loaded (%d parameters), %d KV blocks%s", spec.model,
                 sum(p.numel() for p in self.model.parameters()), spec.num_draft_blocks,
                 f", LM head cut to the {len(spec.token_map_ids)} ids of {spec.token_map}" if spec.token_map_ids else "")

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def release(self, request_ids: Iterable[str]) -> None:
        """Free the draft cache of requests that finished, were aborted or preempted."""
        for rid in request_ids:
            seq = self.seqs.pop(rid, None)
            if seq is not None:
                self._free.extend(reversed(seq.block_ids))

    # -- sleep / wake (executor/memory.py) -------------------------------

    def weights_changed(self) -> None:
        """The draft's weights were updated (draft_weights.flush_draft_state): the cut LM head is stale."""
        self._hot_head = None

    def sleep(self) -> int:
        """Free the draft's KV cache (every request's draft state with it) and, on CUDA, move its
        weights to host memory; kept there at level 2 too (nothing reloads a draft). Freed KV bytes."""
        freed = sum(t.numel() * t.element_size() for cache in self.kv_caches for t in cache)
        self.release(list(self.seqs))
        self._hot_head = None
        self.kv_caches = []
        if self.device.type != "cpu":
            self.model.to("cpu")
        return freed

    def wake_weights(self) -> None:
        if self.device.type != "cpu":
            self.model.to(self.device)

    def wake_kv_cache(self, engine_config) -> None:
        from trillium.models.kv_cache import allocate_kv_caches

        self.kv_caches = allocate_kv_caches(self.model.local_config, engine_config.speculative_config.num_draft_blocks,
                                            self.block_size, engine_config.kv_cache_dtype, self.device)

    @torch.inference_mode()
    def propose_batch(self, states: Sequence, depths: Sequence[int]) -> list[list[int]]:
        """Up to depths[i] greedy drafts after states[i].token_ids (request_id, token_ids)."""
        drafts: list[list[int]] = [[] for _ in states]
        rows = [i for i, (state, depth) in enumerate(zip(states, depths)) if depth > 0
                and self._prepare(state, depth)]
        if not rows:
            return drafts
        seqs = [self.seqs[states[i].request_id] for i in rows]
        lens = [len(states[i].token_ids) for i in rows]
        # First forward: every request's tokens the cache lacks, through its last real token.
        feeds = [states[i].token_ids[seq.num_real :] for i, seq in zip(rows, seqs)]
        tokens = self._step(feeds, [seq.num_real for seq in seqs], seqs)
        for i, seq, length, token in zip(rows, seqs, lens, tokens):
            seq.fed = list(states[i].token_ids)
            seq.num_real = length
            drafts[i].append(token)
        # Then one token per request per further position, batched over those wanting more.
        for j in range(1, max(depths[i] for i in rows)):
            live = [(i, seq) for i, seq in zip(rows, seqs) if depths[i] > j]
            if not live:
                break
            tokens = self._step([[drafts[i][-1]] for i, _ in live], [len(seq.fed) for _, seq in live],
                                [seq for _, seq in live])
            for (i, seq), token in zip(live, tokens):
                seq.fed.append(drafts[i][-1])
                drafts[i].append(token)
        return drafts

    def _prepare(self, state, depth: int) -> bool:
        """Roll the request's cache back to what still matches and give it blocks for this
        proposal; False (no drafts this step) when the pool has too few free blocks."""
        seq = self.seqs.setdefault(state.request_id, _DraftSeq())
        tokens = state.token_ids
        valid = seq.num_real
        limit = min(len(seq.fed), len(tokens) - 1)  # INVARIANT: the last real token is always fed
        while valid < limit and seq.fed[valid] == tokens[valid]:
            valid += 1  # accepted drafts: their KV is the request's own
        valid = min(valid, len(tokens) - 1)
        del seq.fed[valid:]
        seq.num_real = valid
        # Positions written: through the last real token, then drafts 1..depth-1.
        need = -(-(len(tokens) + depth - 1) // self.block_size) - len(seq.block_ids)
        if need > len(self._free):
            return False
        for _ in range(need):
            seq.block_ids.append(self._free.pop())
        return True

    def _step(self, feeds: list[list[int]], starts: list[int], seqs: list[_DraftSeq]) -> list[int]:
        """One draft forward: feeds[r] at positions starts[r]..; the argmax after each feed's last."""
        counts = [len(f) for f in feeds]
        # WHY verify_rows: after a verify, a feed is the accepted drafts and the bonus token (2 to k + 1
        # rows), which as verify rows (each a decode row of its own) runs in the compiled graph rather
        # than eager; a longer feed (a prompt) still takes the prefill path (paged_attention_cpu.py).
        # Q8_0 draft, 1 thread: that step's forward 2.2 -> 1.5 ms.
        meta = AttentionMetadata.build(counts, [s + n for s, n in zip(starts, counts)],
                                       [seq.block_ids for seq in seqs], self.block_size, self.device,
                                       verify_rows=True)
        ids = torch.tensor([t for f in feeds for t in f], dtype=torch.int64, device=self.device)
        positions = torch.tensor([p for s, n in zip(starts, counts) for p in range(s, s + n)],
                                 dtype=torch.int64, device=self.device)
        hidden = self.forward(ids, positions, self.kv_caches, meta)
        if len(feeds) != hidden.shape[0]:
            last = torch.tensor(list(_cumsum(counts)), dtype=torch.int64, device=self.device) - 1
            hidden = hidden.index_select(0, last)
        if self.token_map is None:
            return self.model.compute_logits(hidden).argmax(dim=-1).tolist()
        if self._hot_head is None:
            self._hot_head = hot_head(self.model, self.token_map)
        return self.token_map[self._hot_head(hidden).argmax(dim=-1)].tolist()


def hot_head(model, ids: torch.Tensor):
    """hidden [N, H] -> logits [N, len(ids)] of the tokens `ids` only: the model's LM head cut to their
    rows (a copy: packed GGUF blocks, or float rows). ValueError for a head it cannot cut."""
    from trillium.models.llama import Linear, linear
    from trillium.models.packed_linear import GgufLinear

    head = model.lm_head
    if isinstance(head, GgufLinear):  # its own, or the packed copy of a tied embedding
        bias = None if head.bias is None else head.bias.index_select(0, ids)
        cut = GgufLinear(head.blocks.index_select(0, ids), head.ggml_type, head.in_features, bias, head.activations)
        return lambda hidden: cut(hidden).float()
    if head is None or type(head) in (Linear, torch.nn.Linear):  # the tied embedding's rows, or the head's
        weight = model.lm_head_weight.index_select(0, ids)
        bias = None if head is None or head.bias is None else head.bias.index_select(0, ids)
        return lambda hidden: linear(hidden, weight, bias).float()
    raise ValueError(f"--speculative-config token_map: the draft's LM head ({type(head).__name__}) cannot be cut "
                     "to a token map; use a float or GGUF draft")


def _cumsum(values: list[int]):
    total = 0
    for v in values:
        total += v
        yield total
