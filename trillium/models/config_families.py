"""Family-specific parts of `ModelConfig`: mixture-of-experts, Gemma, per-layer attention windows.

Parsed from an HF config.json dict by `ModelConfig.from_hf_config`; the
model classes (`moe.py`, `gemma.py`) read them. Kept out of `config.py` so
the dense Llama-family fields stay one flat, small object.

    MoeSpec      experts, top-k, expert / shared-expert widths, which layers are sparse
    GemmaSpec    query_pre_attn_scalar, soft-capping, local rope base, (1 + w) norms
    layer_types  per layer "full_attention" | "sliding_attention" (None: all full,
                 or all sliding when `sliding_window` is set, as Mistral)
    pooling      *ForSequenceClassification (a `score` head, `num_labels` rows) and
                 *Model (the bare backbone, as embedding checkpoints ship) read
                 as their causal-LM family (`pooling_base`); `parse_num_labels`
                 sizes the score head

Names and defaults follow transformers' config classes (Qwen2MoeConfig,
Qwen3MoeConfig, MixtralConfig, Gemma2Config, Gemma3TextConfig).
"""

from __future__ import annotations

from typing import Any

import attrs

FULL, SLIDING = "full_attention", "sliding_attention"
MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Pooling checkpoints of the dense Llama family -> the causal-LM architecture whose flags they share.
POOLING_ARCHITECTURES = {
    f"{family}{suffix}": f"{family}ForCausalLM"
    for family in ("Llama", "Mistral", "Qwen2", "Qwen3")
    for suffix in ("ForSequenceClassification", "Model")
}


def pooling_base(architecture: str) -> str:
    """The causal-LM architecture a pooling one is built on (itself for any other)."""
    return POOLING_ARCHITECTURES.get(architecture, architecture)


def parse_num_labels(hf: dict[str, Any], architecture: str) -> int:
    """Rows of a classifier's score head, as transformers' PretrainedConfig counts them
    (len(id2label), else num_labels, else 2); 0 for any other architecture."""
    if not architecture.endswith("ForSequenceClassification"):
        return 0
    if hf.get("id2label"):
        return len(hf["id2label"])
    return int(hf.get("num_labels", 2))


@attrs.frozen
class MoeSpec:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    # Layers whose MLP is the sparse block; the others are dense (intermediate_size).
    sparse_layers: tuple[int, ...]
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one always-on expert behind a sigmoid gate


@attrs.frozen
class GemmaSpec:
    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    # Gemma 3: sliding layers rotate with their own base (no scaling); None: one table for all.
    local_rope_theta: float | None


def parse_moe(hf: dict[str, Any], architecture: str, num_layers: int) -> MoeSpec | None:
    if architecture not in MOE_ARCHITECTURES:
        return None
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if num_experts <= 0:
        raise ValueError(f"{architecture}: config has no experts (num_experts / num_local_experts)")
    mixtral = architecture == "MixtralForCausalLM"
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    if architecture == "Qwen2MoeForCausalLM":
        norm_default = False
    else:
        norm_default = True  # Mixtral always renormalises; Qwen3MoeConfig's default
    return MoeSpec(
        num_experts=num_experts,
        top_k=int(hf.get("num_experts_per_tok", 2)),
        expert_intermediate_size=int(hf["intermediate_size"] if mixtral else hf["moe_intermediate_size"]),
        norm_topk_prob=True if mixtral else bool(hf.get("norm_topk_prob", norm_default)),
        sparse_layers=sparse,
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0)
        if architecture == "Qwen2MoeForCausalLM"
        else 0,
    )


def gguf_moe(get: Any, architecture: str, num_layers: int) -> MoeSpec | None:
    """MoeSpec from llama.cpp metadata (`get(key)` reads `{arch}.key`); every layer is sparse there.

    norm_topk_prob is not stored: llama.cpp's qwen2moe does not renormalise,
    qwen3moe and Mixtral do (as transformers' GGUF_CONFIG_DEFAULTS_MAPPING).
    """
    if architecture not in MOE_ARCHITECTURES:
        return None
    mixtral = architecture == "MixtralForCausalLM"
    norm = get("expert_weights_norm")
    return MoeSpec(
        num_experts=int(get("expert_count")),
        top_k=int(get("expert_used_count")),
        expert_intermediate_size=int(get("feed_forward_length") if mixtral else get("expert_feed_forward_length")),
        norm_topk_prob=bool(norm) if norm is not None else architecture != "Qwen2MoeForCausalLM",
        sparse_layers=tuple(range(num_layers)),
        shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length") or 0),
    )


# llama.cpp fixes these per architecture instead of writing them (llama-model.cpp load_hparams):
# every `pattern`-th layer is full attention, the others slide; Gemma 3's sliding
# layers rotate with base 10000 and no scaling; the 27B sizes (by block count)
# scale attention by hidden / heads instead of head_dim.
_GGUF_GEMMA = {"Gemma2ForCausalLM": {"pattern": 2, "local_rope_theta": None, "27b_layers": 46},
               "Gemma3ForCausalLM": {"pattern": 6, "local_rope_theta": 10000.0, "27b_layers": 62}}  # fmt: skip


def gguf_gemma(
    get: Any, architecture: str, num_layers: int, hidden_over_heads: int, head_dim: int
) -> tuple[GemmaSpec | None, tuple[str, ...] | None]:
    """(GemmaSpec, layer_types) from llama.cpp `gemma2` / `gemma3` metadata (`get(key)` reads `{arch}.key`).

    Soft-capping is `attn_logit_softcapping` / `final_logit_softcapping` (absent: none);
    query_pre_attn_scalar is not stored, so it is derived as llama.cpp derives it.
    """
    if architecture not in GEMMA_ARCHITECTURES:
        return None, None
    fixed = _GGUF_GEMMA[architecture]
    scalar = hidden_over_heads if num_layers == fixed["27b_layers"] else head_dim
    spec = GemmaSpec(
        query_pre_attn_scalar=float(scalar),
        attn_logit_softcapping=_optional_float(get("attn_logit_softcapping")),
        final_logit_softcapping=_optional_float(get("final_logit_softcapping")),
        local_rope_theta=fixed["local_rope_theta"],
    )
    if not get("attention.sliding_window"):
        return spec, None
    pattern = fixed["pattern"]
    types = tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))
    _check_gguf_gemma_fixed(get, architecture, types, fixed["local_rope_theta"])
    return spec, types


def _check_gguf_gemma_fixed(get: Any, architecture: str, types: tuple[str, ...], local: float | None) -> None:
    """Refuse a file whose own layer pattern / local rope base disagrees with what llama.cpp fixes.

    WHY: llama.cpp ignores these gguf-py keys for gemma2 / gemma3, so such a file
    means one thing there and another to a reader that honours them; neither is guessed.
    """
    stored = get("attention.sliding_window_pattern")
    if isinstance(stored, (list, tuple)):
        stored_types = tuple(SLIDING if swa else FULL for swa in stored)
    elif stored is not None:
        n = int(stored)
        stored_types = tuple(FULL if (i + 1) % n == 0 else SLIDING for i in range(len(types)))
    if stored is not None and stored_types != types:
        raise ValueError(f"GGUF {architecture}: attention.sliding_window_pattern {stored} differs from llama.cpp's "
                         f"fixed layer pattern {types}; not supported")  # fmt: skip
    base = get("rope.freq_base_swa")
    if base is not None and float(base) != (local if local is not None else float(get("rope.freq_base", 10000.0))):
        raise ValueError(f"GGUF {architecture}: rope.freq_base_swa {base} differs from llama.cpp's fixed "
                         f"sliding-layer rope base; not supported")  # fmt: skip


def gemma_rope(hf: dict[str, Any], architecture: str) -> tuple[dict[str, Any], float | None]:
    """(the dict `parse_rope_config` reads for the global layers, local rope base or None).

    transformers 5 writes Gemma 3's rope as one `rope_parameters` entry per
    layer type; older configs write `rope_theta` plus `rope_local_base_freq`.
    """
    params = hf.get("rope_parameters")
    if architecture != "Gemma3ForCausalLM":
        return hf, None
    if isinstance(params, dict) and FULL in params:
        local = params.get(SLIDING) or {}
        if local.get("rope_type", "default") != "default":
            raise NotImplementedError(f"Gemma 3 local rope type {local['rope_type']!r} is not supported")
        return {"rope_parameters": params[FULL]}, float(local.get("rope_theta", 10000.0))
    return hf, float(hf.get("rope_local_base_freq", 10000.0))


def parse_gemma(hf: dict[str, Any], architecture: str, local_rope_theta: float | None) -> GemmaSpec | None:
    if architecture not in GEMMA_ARCHITECTURES:
        return None
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{architecture}: use_bidirectional_attention (embedding models) is not supported")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{architecture}: unsupported hidden_activation {act!r} (gelu_pytorch_tanh only)")
    return GemmaSpec(
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or hf.get("head_dim") or 256),
        attn_logit_softcapping=_optional_float(hf.get("attn_logit_softcapping")),
        final_logit_softcapping=_optional_float(hf.get("final_logit_softcapping")),
        local_rope_theta=local_rope_theta,
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def parse_layer_types(
    hf: dict[str, Any], architecture: str, num_layers: int, sliding_window: int | None
) -> tuple[str, ...] | None:
    """Per-layer attention kind, as transformers derives it when config.json has no `layer_types`."""
    if sliding_window is None:
        return None
    types = hf.get("layer_types")
    if types is None:
        if architecture in GEMMA_ARCHITECTURES:
            pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern")
                          or (6 if architecture == "Gemma3ForCausalLM" else 2))  # fmt: skip
            types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
        elif architecture.startswith(("Qwen2", "Qwen3")):
            first = int(hf.get("max_window_layers", 28))
            types = [SLIDING if i >= first else FULL for i in range(num_layers)]
        else:
            return None  # Mistral, Mixtral, Phi-3: every layer
    types = tuple(str(t) for t in types)
    if len(types) != num_layers or not set(types) <= {FULL, SLIDING}:
        raise ValueError(f"layer_types must name {num_layers} layers as {FULL!r} or {SLIDING!r}, got {types}")
    return types
