"""Which model class serves which HF architecture.

    model_class(architecture) -> type[LlamaForCausalLM]

Every class shares `LlamaForCausalLM`'s interface (forward, compute_logits,
load_weights, resolve_weight, checkpoint_weight_names, allocate_kv_caches),
so the executor, weight updates and sleep never ask which family they hold.
`config.SUPPORTED_ARCHITECTURES` is the list a config is checked against;
this table must cover it (tests/models/test_models_families.py checks).
"""

from __future__ import annotations

import importlib

# architecture -> (module, class)
_CLASSES = {
    "LlamaForCausalLM": ("trillium.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("trillium.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("trillium.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("trillium.models.llama", "LlamaForCausalLM"),
    "Phi3ForCausalLM": ("trillium.models.llama", "Phi3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("trillium.models.moe", "MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("trillium.models.moe", "MoeForCausalLM"),
    "MixtralForCausalLM": ("trillium.models.moe", "MoeForCausalLM"),
    "Gemma2ForCausalLM": ("trillium.models.gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("trillium.models.gemma", "GemmaForCausalLM"),
}
ARCHITECTURES = tuple(_CLASSES)


def model_class(architecture: str) -> type:
    if architecture not in _CLASSES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(_CLASSES)}")
    module, name = _CLASSES[architecture]
    return getattr(importlib.import_module(module), name)
