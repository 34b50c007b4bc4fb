"""Gemma 2 and Gemma 3 (text) decoders over the paged KV cache.

Differences from `llama.py`, all following transformers' modeling_gemma2 /
modeling_gemma3 (float32 results agree to rounding):

- embeddings scaled by sqrt(hidden_size) (rounded to the weight dtype, as HF);
- RMSNorms multiply by (1 + weight) (`GemmaRMSNorm`), including Gemma 3's q/k norms;
- four norms per layer: input, post-attention, pre- and post-feedforward,
  each residual added after its post-norm;
- MLP activation gelu_pytorch_tanh;
- attention scale query_pre_attn_scalar ** -0.5, Gemma 2's attention logit
  soft-capping (`kernels.paged_attention(softcap=...)`) and final logit
  soft-capping (cap * tanh(logits / cap));
- alternating sliding-window layers (`ModelConfig.layer_types`); Gemma 3's
  sliding layers rotate with their own base (`GemmaSpec.local_rope_theta`)
  from a second table, `cos_sin_cache_local`.

HF weight names are the same as Llama's (q/k/v/o, gate/up/down, the four
norms), so loading, LoRA and live updates work unchanged. NOTE: Gemma 3's
multimodal checkpoints (Gemma3ForConditionalGeneration) are not loaded; the
text-only Gemma3ForCausalLM is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import nn

from trillium import kernels
from trillium.kernels import AttentionMetadata
from trillium.models.config import ModelConfig
from trillium.models.config_families import SLIDING
from trillium.models.kv_cache import KvCache
from trillium.models.llama import MLP, Attention, LlamaForCausalLM, gelu_tanh_and_mul
from trillium.models.rope import build_cos_sin_cache

if TYPE_CHECKING:
    from trillium.lora import LayerLoRA


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight); the checkpoint stores weight (zero-centred)."""

    def __init__(self, size: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # WHY float32 (1 + w): HF adds in float32 and rounds the product once.
        if x.dtype == torch.float32:
            return kernels.rms_norm(x, 1.0 + self.weight.float(), self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, **factory: Any) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, **factory)
        self.self_attn = Attention(config, layer, GemmaRMSNorm, **factory)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, **factory)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, **factory)
        self.mlp = MLP(config, act_and_mul=gelu_tanh_and_mul, **factory)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, **factory)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KvCache,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
        lora: LayerLoRA | None = None,
    ) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta, cos_sin_cache, lora)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden), lora)
        return hidden + self.post_feedforward_layernorm(mlp)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM / Gemma3ForCausalLM (text)."""

    norm_class = GemmaRMSNorm

    def __init__(self, config: ModelConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._sliding = tuple(config.layer_window(i) is not None and config.layer_types is not None
                              and config.layer_types[i] == SLIDING for i in range(config.num_layers))  # fmt: skip
        local = None
        if config.gemma.local_rope_theta is not None:
            cache = self.cos_sin_cache
            local = torch.empty(cache.shape, dtype=cache.dtype, device=cache.device)
        self.register_buffer("cos_sin_cache_local", local, persistent=False)
        if local is not None and local.device.type != "meta":
            self.reset_rope_cache()

    @staticmethod
    def make_layer(config: ModelConfig, index: int, factory: dict[str, Any]) -> nn.Module:
        return GemmaDecoderLayer(config, index, **factory)

    def _local_config(self) -> ModelConfig:
        return attrs.evolve(self.config, rope_theta=self.config.gemma.local_rope_theta, rope_scaling=None)

    def reset_rope_cache(self) -> None:
        super().reset_rope_cache()
        local = getattr(self, "cos_sin_cache_local", None)
        if local is not None:
            table = build_cos_sin_cache(self._local_config(), self.max_positions, device=local.device)
            with torch.no_grad():
                local.copy_(table)

    def rope_table(self, layer: int) -> torch.Tensor:
        if self.cos_sin_cache_local is not None and self._sliding[layer]:
            return self.cos_sin_cache_local
        return self.cos_sin_cache

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight
        # HF: embed * tensor(hidden ** 0.5) rounded to the weight dtype.
        scale = torch.tensor(self.config.hidden_size**0.5, dtype=weight.dtype)
        return super().embed(input_ids) * scale.to(weight.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.gemma.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
