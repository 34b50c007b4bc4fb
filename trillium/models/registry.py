"""Which model class serves which HF architecture.

    model_class(architecture, runner="generate") -> type[LlamaForCausalLM]

Pooling checkpoints (*ForSequenceClassification, *Model) and any dense
causal LM under `--runner pooling` get `pooling_model.LlamaForPooling`.

Every class shares `LlamaForCausalLM`'s interface (forward, compute_logits,
load_weights, resolve_weight, checkpoint_weight_names, allocate_kv_caches),
so the executor, weight updates and sleep never ask which family they hold.
`config.SUPPORTED_ARCHITECTURES` is the list a config is checked against;
this table must cover it (tests/models/test_models_families.py checks).
"""

from __future__ import annotations

import importlib

from trillium.models.config_families import POOLING_ARCHITECTURES

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
_POOLING = ("trillium.models.pooling_model", "LlamaForPooling")
_CLASSES.update({architecture: _POOLING for architecture in POOLING_ARCHITECTURES})
ARCHITECTURES = tuple(_CLASSES)


def model_class(architecture: str, runner: str = "generate") -> type:
    if runner == "pooling":
        base = POOLING_ARCHITECTURES.get(architecture, architecture)
        if base not in POOLING_ARCHITECTURES.values():
            raise ValueError(f"--runner pooling: {architecture} is not a dense Llama-family model")
        module, name = _POOLING
        return getattr(importlib.import_module(module), name)
    if architecture not in _CLASSES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(_CLASSES)}")
    module, name = _CLASSES[architecture]
    return getattr(importlib.import_module(module), name)
