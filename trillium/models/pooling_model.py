"""Pooling models: the Llama-family decoder with a score head or none, no LM head.

    LlamaForPooling       *ForSequenceClassification (`score`: hidden -> num_labels,
                          no bias, as transformers' LlamaForSequenceClassification)
                          and *Model / *ForCausalLM read as an embedding backbone
    forward(...)          -> final-norm hidden [T, hidden], as LlamaForCausalLM
    pool_head(h [N, hidden]) -> [N, num_labels] score logits (float32), or h
                          itself (float32) when there is no score head

Which rows are pooled (LAST / MEAN / CLS) is the executor's pooling head's
business (`actors/executor/pooler.py`); activation, normalization and
Matryoshka truncation are the api's (`trillium/pooling/outputs.py`).

Weight names: classifier checkpoints hold `model.*` + `score.weight`;
embedding checkpoints saved from transformers' bare `*Model` hold the
backbone names without the `model.` prefix (`layers.0...`, `norm.weight`),
which `_canonical` adds. An `lm_head.weight` (a causal-LM checkpoint served
with `--convert embed`) is ignored.
"""

from __future__ import annotations

from typing import Iterable

import torch

from trillium.models.llama import Linear, LlamaForCausalLM, linear

_OWN_PREFIXES = ("model.", "score.", "lm_head.")


class LlamaForPooling(LlamaForCausalLM):
    def __init__(self, config, *, dtype=None, device=None, max_positions=None) -> None:
        super().__init__(config, dtype=dtype, device=device, max_positions=max_positions)
        self.lm_head = None  # NOTE: built on meta by `empty()`, so dropping it costs nothing
        factory = {"dtype": self.model.embed_tokens.weight.dtype, "device": self.model.embed_tokens.weight.device}
        self.score = Linear(config.hidden_size, config.num_labels, bias=False, **factory) if config.num_labels else None

    @property
    def output_size(self) -> int:
        """Width of one pooled output: num_labels with a score head, else hidden_size."""
        return self.config.num_labels or self.config.hidden_size

    def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] pooled hidden states -> [N, output_size] float32 (the matmul in the model dtype, as HF)."""
        if self.score is None:
            return pooled.float()
        return linear(pooled, self.score.weight).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.config.architecture} served as a pooling model has no LM head")

    @staticmethod
    def _canonical(name: str) -> str:
        return name if name.startswith(_OWN_PREFIXES) else "model." + name

    def _resolve(self, name: str):
        name = self._canonical(name)
        if name.startswith("lm_head."):
            return None
        return super()._resolve(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # WHY canonical names out: the loader checks them against checkpoint_weight_names.
        return super().load_weights((self._canonical(name), tensor) for name, tensor in weights)
