"""The EAGLE proposer (vLLM's "eagle"): a one-layer head over the target's hidden states.

Runs on the executor, after the step's target forward, as a batch-level
hook (`propose_from_hidden`): it reads the target's final hidden states of the
step's rows, which the forward returns anyway (Llama's output after the
final norm: what vLLM feeds EAGLE-1, vllm/v1/worker/gpu_model_runner.py
`target_hidden_states = hidden_states[...]`; EAGLE-3's pre-norm aux states
are not read). Nothing runs when no eagle proposer is configured.

The head (EAGLE-1, vllm/model_executor/models/llama_eagle.py): at position t
it reads the pair (h_t, token_{t+1}), x = fc(cat(embed(token_{t+1}), h_t)),
then Llama decoder layer(s) (layer 0 without input_layernorm), no final
norm; the target's LM head turns the output into the next token's logits,
and the output itself stands in for h_{t+1} when drafting further (vLLM's
EagleProposer.propose, vllm/v1/spec_decode/eagle.py: shift the ids by one,
then one step per extra draft at position + 1). Drafts are greedy (the
argmax, a point mass), which verify.py's rejection sampling keeps exact.

Per request the head keeps a dense KV cache (`HeadKv`, on RequestState):
the pairs of positions start .. end-1. Each step it is cut back to the
request's num_computed_tokens (rollback: rejected drafts and the drafting
steps' own entries, made from head outputs, are dropped) and refilled from
the target's hidden states of the rows the step computed, so the head's
context always holds the target's features. A gap (a prefix-cache hit or a
resumed preemption starts past what the head has) starts the cache afresh
at the step's first position: less context, still exact. A request that
does not draft this step (its adaptive depth is 0, or a prefill chunk) only
keeps its target rows (`HeadKv.pending`, at most 64); the head runs over
them with the next step that drafts: the same entries, read once.
WHY dense, not paged: one small layer per request, allocated in block-size
chunks, freed with the request's state (finish, abort, preempt); its bytes
are counted per target block in the KV budget (config.py `resolve`), and
it never holds more tokens than the request's own computed blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from trillium import kernels
from trillium.models.config import ModelConfig
from trillium.models.llama import linear
from trillium.models.rope import build_cos_sin_cache
from trillium.speculative import eagle_checkpoint


# A request's target rows kept for its next head run at most (then the head runs anyway).
_MAX_PENDING_ROWS = 64


class HeadKv:
    """One request's head KV: per layer [capacity, KH, D] keys and values, positions start .. end-1."""

    __slots__ = ("keys", "values", "start", "length", "chunk", "pending")

    def __init__(self, start: int, chunk: int) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.start = start
        self.length = 0
        self.chunk = chunk  # growth unit in tokens (the target's block size)
        # The target's hidden states of positions end .. end + m - 1, not yet through the head.
        self.pending: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def num_pending(self) -> int:
        return 0 if self.pending is None else self.pending.shape[0]

    @property
    def known_end(self) -> int:
        """One past the last position the cache (or its pending rows) covers."""
        return self.end + self.num_pending

    def defer(self, rows: torch.Tensor) -> None:
        """Keep target hidden rows (the positions at known_end ..) for the next head run."""
        self.pending = rows.clone() if self.pending is None else torch.cat([self.pending, rows])

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def keep_until(self, position: int) -> None:
        """Drop the entries (and pending rows) at positions >= `position`."""
        if position < self.end:
            self.length = max(0, position - self.start)
            self.pending = None
        elif self.pending is not None:
            keep = position - self.end
            self.pending = self.pending[:keep] if keep > 0 else None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put `layer`'s new keys/values after the committed ones; all of them (committed + new)."""
        need = self.length + k.shape[0]
        capacity = -(-need // self.chunk) * self.chunk
        if layer == len(self.keys):
            self.keys.append(k.new_empty((capacity, *k.shape[1:])))
            self.values.append(v.new_empty((capacity, *v.shape[1:])))
        elif self.keys[layer].shape[0] < need:
            for store in (self.keys, self.values):
                grown = store[layer].new_empty((capacity, *store[layer].shape[1:]))
                grown[: self.length] = store[layer][: self.length]
                store[layer] = grown
        self.keys[layer][self.length : need] = k
        self.values[layer][self.length : need] = v
        return self.keys[layer][:need], self.values[layer][:need]


# (cache or None, rows): one sequence's rows of a flat head batch; None: no cache (training)
Segment = tuple[HeadKv | None, int]


class _HeadLayer(nn.Module):
    """A Llama decoder layer over dense per-segment caches; layer 0 has no input norm."""

    def __init__(self, config: ModelConfig, index: int, **factory) -> None:
        super().__init__()
        h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
        self.config = config
        self.index = index
        self.input_norm = nn.Parameter(torch.ones(h, **factory)) if index > 0 else None
        self.qkv = nn.Parameter(torch.empty(q + 2 * kv, h, **factory))
        self.o = nn.Parameter(torch.empty(h, q, **factory))
        self.post_norm = nn.Parameter(torch.ones(h, **factory))
        self.gate_up = nn.Parameter(torch.empty(2 * inter, h, **factory))
        self.down = nn.Parameter(torch.empty(h, inter, **factory))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, segments: Sequence[Segment],
                cos_sin: torch.Tensor) -> torch.Tensor:
        c = self.config
        normed = x if self.input_norm is None else kernels.rms_norm(x, self.input_norm, c.rms_norm_eps)
        q, k, v = linear(normed, self.qkv).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.reshape(-1, c.num_heads, c.head_dim)
        k = k.reshape(-1, c.num_kv_heads, c.head_dim)
        q, k = kernels.rotary_embedding(positions, q, k, cos_sin)
        v = v.reshape(-1, c.num_kv_heads, c.head_dim)
        x = x + linear(self._attend(q, k, v, segments), self.o)
        mlp_in = kernels.rms_norm(x, self.post_norm, c.rms_norm_eps)
        return x + linear(kernels.silu_and_mul(linear(mlp_in, self.gate_up)), self.down)

    def _attend(self, q, k, v, segments: Sequence[Segment]) -> torch.Tensor:
        c = self.config
        outs, row = [], 0
        for kv, n in segments:
            qs, ks, vs = q[row : row + n], k[row : row + n], v[row : row + n]
            past = 0
            if kv is not None:
                past = kv.length
                ks, vs = kv.write(self.index, ks, vs)
            mask = None
            if n > 1:  # causal inside the new rows; every cached row is visible
                mask = (torch.arange(ks.shape[0], device=q.device)[None, :]
                        <= past + torch.arange(n, device=q.device)[:, None])
            # [H, n, D] over [KH, L, D]: each KV head serves num_heads / num_kv_heads query heads
            out = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                                 attn_mask=mask, scale=c.head_dim ** -0.5,
                                                 enable_gqa=c.num_heads != c.num_kv_heads)
            outs.append(out.transpose(0, 1).reshape(n, c.q_size))
            row += n
        return torch.cat(outs) if len(outs) > 1 else outs[0]


class EagleHead(nn.Module):
    """fc + decoder layer(s); `forward` returns the head's hidden states (logits: the target's head)."""

    def __init__(self, config: ModelConfig, *, fc_bias: bool, max_positions: int, dtype=None, device=None) -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        h = config.hidden_size
        self.config = config
        self.fc = nn.Parameter(torch.empty(h, 2 * h, **factory))
        self.fc_bias = nn.Parameter(torch.zeros(h, **factory)) if fc_bias else None
        self.layers = nn.ModuleList(_HeadLayer(config, i, **factory) for i in range(config.num_layers))
        self.register_buffer("cos_sin", build_cos_sin_cache(config, max_positions, device=device), persistent=False)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                segments: Sequence[Segment]) -> torch.Tensor:
        x = linear(torch.cat([embeds, hidden], dim=-1), self.fc, self.fc_bias)
        for layer in self.layers:
            x = layer(x, positions, segments, self.cos_sin)
        for kv, n in segments:
            if kv is not None:
                kv.length += n  # every layer wrote its rows: commit them
        return x

    # -- weights in the checkpoint's HF names ---------------------------

    def load_hf(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.fc.copy_(weights["fc.weight"])
            if self.fc_bias is not None:
                self.fc_bias.copy_(weights["fc.bias"])
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                w = {name.removeprefix(p): t for name, t in weights.items() if name.startswith(p)}
                layer.qkv.copy_(torch.cat([w[f"self_attn.{n}_proj.weight"] for n in "qkv"]))
                layer.o.copy_(w["self_attn.o_proj.weight"])
                layer.gate_up.copy_(torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]))
                layer.down.copy_(w["mlp.down_proj.weight"])
                layer.post_norm.copy_(w["post_attention_layernorm.weight"])
                if layer.input_norm is not None:
                    layer.input_norm.copy_(w["input_layernorm.weight"])

    def hf_weights(self) -> dict[str, torch.Tensor]:
        c = self.config
        out = {"fc.weight": self.fc}
        if self.fc_bias is not None:
            out["fc.bias"] = self.fc_bias
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            q, k, v = layer.qkv.split([c.q_size, c.kv_size, c.kv_size])
            gate, up = layer.gate_up.chunk(2)
            out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                        p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.o,
                        p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                        p + "mlp.down_proj.weight": layer.down, p + "post_attention_layernorm.weight": layer.post_norm})
            if layer.input_norm is not None:
                out[p + "input_layernorm.weight"] = layer.input_norm
        return {name: t.detach() for name, t in out.items()}


def load_head(path: str | Path, target_config: ModelConfig, *, max_positions: int, dtype, device) -> EagleHead:
    """Read and check an EAGLE checkpoint (eagle_checkpoint.py) into a head on `device`."""
    config = eagle_checkpoint.read_config(path)
    eagle_checkpoint.check_against_target(config, target_config, path)
    weights = eagle_checkpoint.read_weights(path, config)
    head = EagleHead(config, fc_bias="fc.bias" in weights, max_positions=max_positions, dtype=dtype, device=device)
    head.load_hf(weights)
    return head.eval()


class EagleProposer:
    """Drafts for a step's requests from the target's hidden states (see the module docstring)."""

    reads_hidden_states = True  # the executor calls propose_from_hidden, not propose

    def __init__(self, head: EagleHead, target, block_size: int) -> None:
        self.head = head
        self.target = target  # the target model: its embedding and LM head are shared
        self.block_size = block_size

    def propose(self, token_ids, max_tokens):  # the per-request protocol: not usable without hidden states
        raise TypeError("the eagle proposer reads hidden states: call propose_from_hidden")

    def propose_from_hidden(self, hidden: torch.Tensor, rows: Sequence[tuple]) -> dict[str, list[int]]:
        """rows: (state, first hidden row, rows scheduled, depth) per request of the step (depth 0:
        refill the head's cache only). state: .request_id, .token_ids (this step's tokens
        appended), .num_computed_tokens (the step's first position), .eagle_kv. Drafts by request id."""
        segments, inputs, tokens, positions, wanted = [], [], [], [], []
        row_end = 0
        for state, first, n, depth in rows:
            begin = state.num_computed_tokens
            n = min(n, len(state.token_ids) - 1 - begin)  # rows whose next token is known
            if n <= 0:
                continue
            kv = state.eagle_kv
            if kv is None or kv.known_end < begin:
                kv = state.eagle_kv = HeadKv(begin, self.block_size)
            kv.keep_until(begin)  # rollback
            kv.defer(hidden[first : first + n])
            # WHY deferred: a request not drafting this step (adaptive depth 0, a prefill chunk)
            # runs the head later over all its rows at once: the same entries, fewer weight reads.
            if depth <= 0 and kv.num_pending < _MAX_PENDING_ROWS:
                continue
            m, start = kv.num_pending, kv.end
            segments.append((kv, m))
            inputs.append(kv.pending)
            kv.pending = None
            tokens.extend(state.token_ids[start + 1 : start + 1 + m])
            positions.extend(range(start, start + m))
            row_end += m
            if depth > 0:
                wanted.append((state, kv, depth, row_end - 1, start + m - 1))
        if not segments:
            return {}
        out = self._run(torch.cat(inputs) if len(inputs) > 1 else inputs[0], tokens, positions, segments)
        if not wanted:
            return {}
        rows_t = torch.tensor([w[3] for w in wanted], dtype=torch.long, device=hidden.device)
        return self._draft(out.index_select(0, rows_t), wanted)

    def _run(self, hidden: torch.Tensor, tokens: list[int], positions: list[int], segments) -> torch.Tensor:
        ids = torch.tensor(tokens, dtype=torch.long, device=hidden.device)
        pos = torch.tensor(positions, dtype=torch.long, device=hidden.device)
        return self.head(self.target.embed(ids), hidden, pos, segments)

    def _draft(self, feature: torch.Tensor, wanted: list[tuple]) -> dict[str, list[int]]:
        """Greedy drafts, one head step per extra token, batched over the requests still drafting."""
        drafts: dict[str, list[int]] = {}
        alive = list(range(len(wanted)))
        step = 0
        while True:
            picks = self.target.compute_logits(feature).argmax(dim=-1).tolist()
            for i, token in zip(alive, picks):
                drafts.setdefault(wanted[i][0].request_id, []).append(token)
            step += 1
            keep = [k for k, i in enumerate(alive) if wanted[i][2] > step]
            if not keep:
                return drafts
            alive = [alive[k] for k in keep]
            feature = feature.index_select(0, torch.tensor(keep, dtype=torch.long, device=feature.device))
            tokens = [drafts[wanted[i][0].request_id][-1] for i in alive]
            positions = [wanted[i][4] + step for i in alive]
            feature = self._run(feature, tokens, positions, [(wanted[i][1], 1) for i in alive])


def build_eagle_proposer(speculative_config, model, engine_config, device) -> EagleProposer:
    from trillium.speculative.config import MAX_SPECULATIVE_TOKENS

    head = load_head(speculative_config.model, model.config, dtype=model.dtype, device=device,
                     max_positions=engine_config.max_model_len + MAX_SPECULATIVE_TOKENS + 1)
    return EagleProposer(head, model, engine_config.block_size)
