"""Megatron-style sharding of the dense Llama family over a `TpGroup`.

    TpShard(group, config): what rank `group.rank` of `group.size` holds
      .local_config        ModelConfig with this rank's heads, KV heads, MLP width, vocab rows
      .shard(name, full)   an HF tensor -> this rank's slice (views; zero-padded vocab rows)
      .split_dim(name)     0 / 1: the dim it is cut on (LoRA pairs follow it: lora/tensor_parallel.py)
      .read(name, slice)   the same slice read straight from a safetensors `get_slice`
      .part(name)          (dim, first, count) of that slice, for other layouts (GGUF: gguf_tensor_parallel.py)
      .parallelize(model)  o_proj / down_proj become RowParallelLinear (all-reduce)

Layout on rank r of N (H heads, KH KV heads, I MLP width, V vocab, Vr = ceil(V / N)):

    q_proj, gate/up_proj   rows [r*H/N*D, +H/N*D), [r*I/N, +I/N)      column-parallel
    k_proj, v_proj         KH >= N: rows of KV heads [r*KH/N, +KH/N)
                           KH <  N: KV head r // (N/KH), replicated on N/KH ranks
    o_proj, down_proj      columns (the same heads / MLP slice)        row-parallel + all-reduce;
                           their bias is added on rank 0 only
    embed_tokens, lm_head  rows [r*Vr, +Vr), the last rank's padded with zeros
    norms (q/k norm too)   replicated

The embedding looks up the ids in this rank's rows (zeros elsewhere) and
all-reduces; the LM head's partial logits [n, Vr] are gathered to rank 0
and cut to V columns: sampling runs once, there. A query head h uses KV
head h // (H/KH) on every layout above, so attention needs no collective.

What cannot be split is refused at start (`distributed/tp_checks.py`).
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from trillium.distributed.tp_group import NO_TP, TpGroup
from trillium.models.config import ModelConfig
from trillium.models.llama import Linear, linear

# HF weight-name suffix -> (dim, part): dim 0 splits rows, dim 1 columns.
_SPLITS = {
    "self_attn.q_proj.weight": (0, "q"), "self_attn.q_proj.bias": (0, "q"),
    "self_attn.k_proj.weight": (0, "kv"), "self_attn.k_proj.bias": (0, "kv"),
    "self_attn.v_proj.weight": (0, "kv"), "self_attn.v_proj.bias": (0, "kv"),
    "self_attn.o_proj.weight": (1, "q"), "self_attn.o_proj.bias": (None, "first"),
    "mlp.gate_proj.weight": (0, "inter"), "mlp.up_proj.weight": (0, "inter"),
    "mlp.gate_proj.bias": (0, "inter"), "mlp.up_proj.bias": (0, "inter"),
    "mlp.down_proj.weight": (1, "inter"), "mlp.down_proj.bias": (None, "first"),
    "embed_tokens.weight": (0, "vocab"), "lm_head.weight": (0, "vocab"),
}


@attrs.define(eq=False)
class TpShard:
    group: TpGroup
    config: ModelConfig  # the full model's

    @staticmethod
    def whole(config: ModelConfig) -> "TpShard":
        """One rank holding everything (no tensor parallelism)."""
        return TpShard(NO_TP, config)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def vocab_rows(self) -> int:
        return -(-self.config.vocab_size // self.size)

    @property
    def local_config(self) -> ModelConfig:
        c, n = self.config, self.size
        if n == 1:
            return c
        return attrs.evolve(c, num_heads=c.num_heads // n, num_kv_heads=max(1, c.num_kv_heads // n),
                            intermediate_size=c.intermediate_size // n, vocab_size=self.vocab_rows)

    def _range(self, part: str) -> tuple[int, int]:
        """(first index, count) of this rank's part, in heads' rows or elements."""
        c, n, r = self.config, self.size, self.rank
        if part == "q":
            per = c.num_heads // n * c.head_dim
            return r * per, per
        if part == "kv":
            if c.num_kv_heads >= n:
                per = c.num_kv_heads // n
                return r * per * c.head_dim, per * c.head_dim
            return r // (n // c.num_kv_heads) * c.head_dim, c.head_dim
        if part == "inter":
            per = c.intermediate_size // n
            return r * per, per
        rows = self.vocab_rows
        return r * rows, rows

    def _split(self, name: str) -> tuple[int | None, str] | None:
        if self.size == 1:
            return None
        for suffix, split in _SPLITS.items():
            if name.endswith(suffix):
                return split
        return None

    def split_dim(self, name: str) -> int | None:
        """0 (rows) or 1 (columns) where the HF tensor `name` is cut; None when it is not (or only its bias)."""
        split = self._split(name)
        return None if split is None else split[0]

    def splits(self, name: str) -> bool:
        """Whether the HF tensor `name` differs between the ranks (False without TP)."""
        return self._split(name) is not None

    def part(self, name: str) -> tuple[int | None, int, int] | None:
        """(dim, first index, count) of this rank's slice of HF tensor `name`; None when it is replicated.

        dim None: a row-parallel layer's bias, whole on rank 0 and zero elsewhere. `count` may run past
        the tensor's end (the vocabulary's last rank): those rows are zero.
        """
        split = self._split(name)
        if split is None:
            return None
        dim, part = split
        if dim is None:
            return None, 0, 0
        return (dim, *self._range(part))

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full HF tensor `name` (unchanged when replicated)."""
        split = self._split(name)
        if split is None:
            return tensor
        dim, part = split
        if dim is None:  # a row-parallel layer's bias: counted once, on rank 0
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        start, count = self._range(part)
        end = min(start + count, tensor.shape[dim])
        return _pad(tensor.narrow(dim, start, max(0, end - start)), dim, count)

    def read(self, name: str, source) -> torch.Tensor:
        """This rank's slice from a safetensors `get_slice` handle: only those bytes are read."""
        split = self._split(name)
        if split is None or split[0] is None:
            return self.shard(name, source[:])
        dim, part = split
        full = source.get_shape()
        start, count = self._range(part)
        end = min(start + count, full[dim])
        index = tuple(slice(start, end) if d == dim else slice(None) for d in range(len(full)))
        return _pad(source[index], dim, count)

    def parallelize(self, model) -> None:
        """Swap each layer's o_proj and down_proj for a RowParallelLinear with the same parameters."""
        if self.size == 1:
            return
        for layer in model.model.layers:
            for parent, attr in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
                old = getattr(parent, attr)
                new = RowParallelLinear.__new__(RowParallelLinear)
                new.__dict__.update(old.__dict__)
                new.group = self.group
                setattr(parent, attr, new)

    # -- the vocabulary ------------------------------------------------------

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return F.embedding(input_ids, weight)
        first = self.rank * self.vocab_rows
        local = input_ids - first
        outside = (local < 0) | (local >= self.vocab_rows)
        hidden = F.embedding(local.masked_fill(outside, 0), weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(hidden)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor | None:
        """[n, Vr] partial logits -> [n, V] on rank 0; None on the others."""
        if self.size == 1:
            return logits
        full = self.group.gather_to_first(logits, dim=-1)
        return None if full is None else full[:, : self.config.vocab_size]


def _pad(piece: torch.Tensor, dim: int, count: int) -> torch.Tensor:
    """The vocabulary's last rank: zero rows up to `count` (never looked up, cut from the logits)."""
    if piece.shape[dim] >= count:
        return piece
    return F.pad(piece, [0, 0] * (piece.dim() - 1 - dim) + [0, count - piece.shape[dim]])


class RowParallelLinear(Linear):
    """Input columns split over the ranks: partial product, bias on rank 0 only (it is zero elsewhere), sum."""

    group: TpGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(linear(x, self.weight, self.bias))

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        """The partial product (plus a LoRA delta: llama.project_with_lora) summed over the ranks."""
        return self.group.all_reduce(out)
