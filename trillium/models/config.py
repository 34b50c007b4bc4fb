"""ModelConfig: the architecture facts the model, loader and executor need.

One frozen attrs object built from either an HF `config.json` (plus
`generation_config.json` for extra EOS ids) or GGUF metadata. Everything
downstream (model construction, KV cache sizing, rope tables) reads this
object only, never the raw dicts.

Supported architectures: `SUPPORTED_ARCHITECTURES`. The dense Llama family
(Llama, Mistral, Qwen2, Qwen3, Phi-3) differ only in flags:

    attention_bias        q/k/v projections have a bias (Qwen2: always)
    attention_out_bias    o_proj has a bias (Llama/Qwen3 `attention_bias`)
    qk_norm               per-head RMSNorm on q and k before rope (Qwen3, Gemma 3)
    sliding_window        keys further back than this are masked, in every
                          layer or in the layers `layer_types` marks sliding

Mixture-of-experts (Qwen2-MoE, Qwen3-MoE, Mixtral) add `moe`, Gemma 2 / 3
add `gemma` (`config_families.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import torch

from trillium.models.config_families import (
    GEMMA_ARCHITECTURES,
    SLIDING,
    POOLING_ARCHITECTURES,
    GemmaSpec,
    MoeSpec,
    gemma_rope,
    gguf_gemma,
    gguf_moe,
    parse_gemma,
    parse_layer_types,
    parse_moe,
    parse_num_labels,
    pooling_base,
)
from trillium.models.rope import parse_rope_config

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    *POOLING_ARCHITECTURES,
)
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
_QWEN2_STYLE = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")  # q/k/v bias, no o_proj bias
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical name ('float32', 'bfloat16', 'float16') of a dtype or its name."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
    return str(_DTYPES[dtype]).removeprefix("torch.")


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    return _DTYPES[dtype_name(dtype)]


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _unique(ids: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


@attrs.frozen
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    attention_out_bias: bool
    mlp_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # None: every layer uses sliding_window (if any)
    moe: MoeSpec | None = None
    gemma: GemmaSpec | None = None
    num_labels: int = 0  # *ForSequenceClassification: rows of the score head; 0: none

    @property
    def family_architecture(self) -> str:
        """The causal-LM architecture whose flags this one shares (pooling checkpoints)."""
        return pooling_base(self.architecture)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention, or None for full causal."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id (the first of `eos_token_ids`)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @staticmethod
    def from_hf_config(hf: dict[str, Any], generation_config: dict[str, Any] | None = None) -> "ModelConfig":
        """Parse an HF config.json dict (optionally with generation_config.json)."""
        archs = hf.get("architectures") or []
        named = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(hf.get("model_type", ""), "")
        if named not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {named or hf.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        # Pooling checkpoints (Qwen3Model, LlamaForSequenceClassification) take their family's flags.
        architecture = pooling_base(named)
        is_gemma = architecture in GEMMA_ARCHITECTURES
        if not is_gemma and hf.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}; {architecture} models use silu")
        num_heads = int(hf["num_attention_heads"])
        hidden_size = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden_size // num_heads
        rope_source, local_rope_theta = gemma_rope(hf, architecture)
        _check_full_rotary(rope_source, architecture)
        rope_theta, rope_scaling = parse_rope_config(rope_source)
        is_qwen2 = architecture in _QWEN2_STYLE
        attention_bias = bool(hf.get("attention_bias", False))
        sliding_window = hf.get("sliding_window")
        if architecture.startswith(("Qwen2", "Qwen3")):
            # Qwen configs carry a sliding_window value that is only used when this flag is set.
            sliding_window = sliding_window if hf.get("use_sliding_window", False) else None
        sliding_window = int(sliding_window) if sliding_window else None
        num_layers = int(hf["num_hidden_layers"])
        eos = _as_id_tuple(hf.get("eos_token_id"))
        if generation_config:
            eos = eos + _as_id_tuple(generation_config.get("eos_token_id"))
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        return ModelConfig(
            architecture=named,
            model_type=hf.get("model_type") or _MODEL_TYPE_BY_ARCH[architecture],
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=True if is_qwen2 else attention_bias,
            attention_out_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=architecture in _QK_NORM_ARCHITECTURES,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_unique(eos),
            dtype=dtype_name(dtype),
            sliding_window=sliding_window,
            layer_types=parse_layer_types(hf, architecture, num_layers, sliding_window),
            moe=parse_moe(hf, architecture, num_layers),
            gemma=parse_gemma(hf, architecture, local_rope_theta),
            num_labels=parse_num_labels(hf, named),
        )

    @staticmethod
    def from_hf_dir(path: str | Path) -> "ModelConfig":
        """Read config.json (and generation_config.json if present) from a directory."""
        path = Path(path)
        hf = json.loads((path / "config.json").read_text())
        gen_path = path / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
        return ModelConfig.from_hf_config(hf, generation)

    @staticmethod
    def from_gguf_metadata(
        metadata: dict[str, Any], tensor_names: set[str] | frozenset[str]
    ) -> "ModelConfig":
        """Parse GGUF key/values (`gguf_checkpoint.read_metadata`) and tensor names."""
        arch = metadata["general.architecture"]
        if arch == "clip":
            raise ValueError(
                "this GGUF is a multimodal projector (llama.cpp mmproj, architecture 'clip'); Trillium serves "
                "text only: load the model's text GGUF (e.g. the gemma3 file) without the mmproj"
            )
        if arch not in _ARCH_BY_GGUF:
            raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCH_BY_GGUF)}")
        architecture = _ARCH_BY_GGUF[arch]
        name = str(metadata.get("general.name", "")).lower()
        if arch == "llama" and metadata.get("llama.expert_count"):
            architecture = "MixtralForCausalLM"  # llama.cpp writes Mixtral as llama with experts
        elif arch == "llama" and "mistral" in name:
            architecture = "MistralForCausalLM"  # same weights layout; as transformers does
        if any(n.startswith("rope_factors_") for n in tensor_names):
            raise NotImplementedError(f"GGUF {arch}: longrope (rope_factors_long/short) is not supported")

        def get(key: str, default: Any = None) -> Any:
            return metadata.get(f"{arch}.{key}", default)

        hidden_size = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        num_kv_heads = int(get("attention.head_count_kv") or num_heads)
        head_dim = get("attention.key_length")
        if head_dim is None and arch == "llama":
            head_dim = get("rope.dimension_count")
        head_dim = int(head_dim or hidden_size // num_heads)
        vocab_size = get("vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
        rope_scaling = _gguf_rope_scaling(get, metadata)
        eos = _as_id_tuple(metadata.get("tokenizer.ggml.eos_token_id"))
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            eos += _as_id_tuple(metadata.get(key))
        has_bias = "blk.0.attn_q.bias" in tensor_names or "blk.0.attn_qkv.bias" in tensor_names
        num_layers = int(get("block_count"))
        window = get("attention.sliding_window")
        gemma, layer_types = gguf_gemma(get, architecture, num_layers, hidden_size // num_heads, head_dim)
        return ModelConfig(
            architecture=architecture,
            model_type=_MODEL_TYPE_BY_ARCH[architecture],
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias=has_bias,
            attention_out_bias="blk.0.attn_output.bias" in tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_unique(eos),
            # NOTE: GGUF weights are dequantized to float32; callers may ask for less.
            dtype="float32",
            sliding_window=int(window) if window else None,
            layer_types=layer_types,
            moe=gguf_moe(get, architecture, num_layers),
            gemma=gemma,
        )


def _check_full_rotary(hf: dict[str, Any], architecture: str) -> None:
    """Refuse partial rotary embeddings (Phi-4-mini's 0.75): the kernels rotate the whole head."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor is not None and float(factor) != 1.0:
        raise NotImplementedError(f"{architecture}: partial_rotary_factor={factor} is not supported (only 1.0)")


def _gguf_rope_scaling(get: Any, metadata: dict[str, Any]) -> dict[str, Any] | None:
    rope_type = get("rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    factor = float(get("rope.scaling.factor", 1.0))
    if rope_type == "linear":
        return {"rope_type": "linear", "factor": factor}
    if rope_type == "yarn":
        original = get("rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise NotImplementedError(f"GGUF rope scaling type {rope_type!r} is not supported")


_ARCH_BY_GGUF = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",  # llama.cpp writes Gemma 3's text weights only (vision: a separate mmproj)
}
_MODEL_TYPE_BY_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
}
_ARCH_BY_MODEL_TYPE = {v: k for k, v in _MODEL_TYPE_BY_ARCH.items()}
