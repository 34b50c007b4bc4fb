"""Mixture-of-experts decoders: Qwen2-MoE, Qwen3-MoE, Mixtral, over the paged KV cache.

The attention, norms and residuals are `llama.py`'s (Qwen2-MoE: q/k/v bias,
Qwen3-MoE: q/k RMSNorm, per `ModelConfig`); the MLP of each sparse layer
(`MoeSpec.sparse_layers`) is a `SparseMoeBlock`:

    router logits = gate(x)            [T, E]
    weights, ids  = top-k of softmax   (renormalised: Mixtral, Qwen3 norm_topk_prob)
    y             = sum_k weights * expert_ids(x)          (`kernels.moe.fused_moe`)
                  + sigmoid(shared_expert_gate(x)) * shared_expert(x)   (Qwen2-MoE only)

Layers outside `sparse_layers` (`mlp_only_layers`, `decoder_sparse_step`)
keep a dense MLP of `intermediate_size`, as transformers builds them.

Weights: the experts of a layer are stacked into two parameters,
`experts.w13_weight` [E * 2I, H] (per expert [gate | up] rows) and
`experts.w2_weight` [E * H, I], so every HF tensor is a row slice of one
parameter and live updates (`resolve_weight`, shadow weights) work as for
the dense models. HF names accepted: the Hub's per-expert names
(`mlp.experts.N.gate_proj.weight`; Mixtral `block_sparse_moe.experts.N.w1`)
and transformers 5's fused in-memory names (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj`), which a trainer's `named_parameters()`
yields.

LoRA: adapters on attention projections apply; adapters on expert or MLP
weights are refused when loaded (`trillium/lora/adapter.py`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch import nn

from trillium.kernels import moe as moe_kernels
from trillium.models.config import ModelConfig
from trillium.models.llama import MLP, DecoderLayer, Linear, LlamaForCausalLM, linear

if TYPE_CHECKING:
    from trillium.lora import LayerLoRA

_PER_EXPERT = re.compile(
    r"^(?P<prefix>model\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>model\.layers\.\d+\.)mlp\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_SHARED = re.compile(r"^(?P<prefix>model\.layers\.\d+\.)mlp\.shared_expert\.(?P<proj>gate_proj|up_proj)\.weight$")
_GATE_SHARD = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}
# Our per-layer parameter -> the Hub names it holds (format args: expert index), per naming scheme.
_HUB_NAMES = {
    "qwen": ("mlp.experts.{}.gate_proj.weight", "mlp.experts.{}.up_proj.weight", "mlp.experts.{}.down_proj.weight"),
    "mixtral": (
        "block_sparse_moe.experts.{}.w1.weight",
        "block_sparse_moe.experts.{}.w3.weight",
        "block_sparse_moe.experts.{}.w2.weight",
    ),
}


class Experts(nn.Module):
    """E expert MLPs' weights, stacked (see the module docstring)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, **factory: Any) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.w13_weight = nn.Parameter(torch.empty(num_experts * 2 * inter, hidden, **factory))
        self.w2_weight = nn.Parameter(torch.empty(num_experts * hidden, inter, **factory))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w13 = self.w13_weight.view(self.num_experts, 2 * self.inter, self.hidden)
        w2 = self.w2_weight.view(self.num_experts, self.hidden, self.inter)
        return moe_kernels.fused_moe(x, w13, w2, weights, ids)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, **factory: Any) -> None:
        super().__init__()
        spec = config.moe
        self.top_k, self.renormalize = spec.top_k, spec.norm_topk_prob
        self.gate = Linear(config.hidden_size, spec.num_experts, bias=False, **factory)
        self.experts = Experts(spec.num_experts, config.hidden_size, spec.expert_intermediate_size, **factory)
        self.shared_expert = None
        self.shared_expert_gate = None
        if spec.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, spec.shared_expert_intermediate_size, **factory)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False, **factory)

    def forward(self, x: torch.Tensor, lora: LayerLoRA | None = None) -> torch.Tensor:
        # NOTE: `lora` only ever carries attention deltas here: adapters that
        # touch an MoE model's MLP are refused at load (lora/adapter.py).
        weights, ids = moe_kernels.route(linear(x, self.gate.weight), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = torch.sigmoid(linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
            out = out + shared
        return out


class MoeForCausalLM(LlamaForCausalLM):
    """Llama-family decoder whose sparse layers' MLP is a `SparseMoeBlock`."""

    @staticmethod
    def make_layer(config: ModelConfig, index: int, factory: dict[str, Any]) -> nn.Module:
        mlp = SparseMoeBlock(config, **factory) if index in config.moe.sparse_layers else None
        return DecoderLayer(config, index, mlp, **factory)

    @property
    def _naming(self) -> str:
        return "mixtral" if self.config.architecture == "MixtralForCausalLM" else "qwen"

    def _resolve(self, name: str) -> tuple[str, tuple[int, int] | None] | None:
        spec = self.config.moe
        inter, hidden = spec.expert_intermediate_size, self.config.hidden_size
        if match := _PER_EXPERT.match(name):
            expert, proj, prefix = int(match["expert"]), match["proj"], match["prefix"]
            if expert >= spec.num_experts:
                return name, None  # no such parameter: load_weights raises KeyError naming it
            if proj in _GATE_SHARD:
                return f"{prefix}mlp.experts.w13_weight", ((2 * expert + _GATE_SHARD[proj]) * inter, inter)
            return f"{prefix}mlp.experts.w2_weight", (expert * hidden, hidden)
        if match := _FUSED_EXPERTS.match(name):
            kind = "w13_weight" if match["proj"] == "gate_up_proj" else "w2_weight"
            return f"{match['prefix']}mlp.experts.{kind}", None
        if match := _SHARED.match(name):
            size = spec.shared_expert_intermediate_size
            rows = (0, size) if match["proj"] == "gate_proj" else (size, size)
            return f"{match['prefix']}mlp.shared_expert.gate_up_proj.weight", rows
        if ".block_sparse_moe.gate." in name:
            return name.replace(".block_sparse_moe.gate.", ".mlp.gate."), None
        return super()._resolve(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As `LlamaForCausalLM.load_weights`; transformers 5's 3-D expert tensors are flattened first."""

        def flattened() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if tensor.dim() == 3 and _FUSED_EXPERTS.match(name):
                    tensor = tensor.reshape(-1, tensor.shape[-1])
                yield name, tensor

        return super().load_weights(flattened())

    def checkpoint_weight_names(self) -> list[str]:
        """The Hub's names: one tensor per expert and projection."""
        gate_name, up_name, down_name = _HUB_NAMES[self._naming]
        num_experts = self.config.moe.num_experts
        names = []
        for name in super().checkpoint_weight_names():
            prefix, sep, rest = name.partition("mlp.")
            if not sep:
                names.append(name)
            elif rest == "experts.w13_weight":
                names.extend(prefix + n.format(e) for e in range(num_experts) for n in (gate_name, up_name))
            elif rest == "experts.w2_weight":
                names.extend(prefix + down_name.format(e) for e in range(num_experts))
            elif rest == "shared_expert.gate_up_proj.weight":
                names.extend(prefix + f"mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj"))
            elif rest == "gate.weight" and self._naming == "mixtral":
                names.append(prefix + "block_sparse_moe.gate.weight")
            else:
                names.append(name)
        return names
