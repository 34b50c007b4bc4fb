"""Small deterministic random HF checkpoints for tests and benchmarks.

    build_checkpoint(path, variant, *, dtype="float32", seed=0, sharded=False, **config_overrides) -> Path

writes an HF directory that transformers and Trillium both load:
config.json, model.safetensors (or, with sharded=True, two shards plus
model.safetensors.index.json), generation_config.json, tokenizer.json
(byte-level BPE trained on `synthetic_corpus.CORPUS`) and
tokenizer_config.json with a small chat template.

Variants (all tiny except "bench"):

    llama          GQA 4/2, llama3 rope scaling          (legacy `rope_scaling` keys)
    llama-linear   linear rope scaling                   (transformers 5 `rope_parameters`)
    llama-dynamic  dynamic NTK rope scaling
    llama-tied     tied embeddings, plain rope
    mistral        MistralForCausalLM, MQA 4/1, no sliding window
    qwen2          qkv bias, no BOS added by the tokenizer
    qwen3          per-head q/k RMSNorm, head_dim 32 != hidden / heads
    mistral-sliding  MistralForCausalLM with a 24-token sliding window
    phi3           Phi3ForCausalLM: fused qkv_proj / gate_up_proj in the checkpoint, window 32
    qwen2-moe      4 experts top-2 + a shared expert behind a sigmoid gate, norm_topk_prob false
    qwen3-moe      8 experts top-2, norm_topk_prob, q/k norm; layer 1 dense (mlp_only_layers)
    mixtral        4 experts top-2 (block_sparse_moe / w1 w2 w3 names)
    gemma2         soft-capping, (1 + w) norms, alternating 16-token sliding layers
    gemma3         3 layers (sliding, sliding, full), local rope base, q/k norm, linear global rope
    llama-classify LlamaForSequenceClassification, 3 labels (score head)
    qwen3-reward   Qwen3ForSequenceClassification, 1 label (a reward model / cross-encoder)
    mistral-classify MistralForSequenceClassification, 2 labels
    qwen3-embed    Qwen3Model (no LM head, names without "model."), matryoshka_dimensions
    bench-embed, bench-rerank  the bench backbone as LlamaModel / a 1-label classifier
    bench          Llama, hidden 512, 8 layers, 8/4 heads, vocab 8192 (~32M params)

The families after qwen3 get their weight names and shapes from the model
class itself (`_family_weight_specs`); the first ones keep their original
spec list, so their files stay byte-identical.

Weights come from one seeded torch.Generator, scaled so activations stay
O(1) and logits spread over a few units: greedy picks are not near-ties.
Same arguments -> byte-identical files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from trillium.models.config import ModelConfig, dtype_name, torch_dtype
from trillium.models.synthetic_corpus import CORPUS
from trillium.models.synthetic_variants import _VARIANTS, POOLING_VARIANTS, VARIANTS

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
PAD_ID, BOS_ID, EOS_ID, END_ID = 0, 1, 2, 6
CHAT_TEMPLATE = (
    "{% if add_bos %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_SMALL = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
# Tokenizers of these variants add no BOS (as Qwen's do); the others add <|bos|>.
_NO_BOS_VARIANTS = ("qwen2", "qwen3", "qwen2-moe", "qwen3-moe", "qwen3-reward", "qwen3-embed")
# Variants whose weight list comes from the model class (see the module docstring).
_FAMILY_VARIANTS = ("mistral-sliding", "phi3", "qwen2-moe", "qwen3-moe", "mixtral", "gemma2", "gemma3",
                    *POOLING_VARIANTS)


def hf_config_dict(variant: str, dtype: str = "float32", **overrides: Any) -> dict[str, Any]:
    """The config.json content for a variant (before writing)."""
    if variant not in _VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
    config: dict[str, Any] = {**_SMALL, **_VARIANTS[variant], **overrides}
    config = {k: v for k, v in config.items() if v is not None or k == "sliding_window"}
    if "hidden_activation" not in config:
        config["hidden_act"] = "silu"
    config.update(
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=0.02,
    )
    dtype_key = "dtype" if "rope_parameters" in config else "torch_dtype"
    config[dtype_key] = dtype_name(dtype)
    return config


def build_tokenizer(vocab_size: int, add_bos: bool) -> Tokenizer:
    """Byte-level BPE trained on the built-in corpus, padded with extra tokens to `vocab_size`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing < 0:
        raise ValueError(f"vocab_size {vocab_size} is below the byte alphabet + specials")
    if missing:
        tokenizer.add_tokens([AddedToken(f"<|extra_{i}|>", special=True) for i in range(missing)])
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", BOS_ID)]
        )
    return tokenizer


def _tokenizer_config(max_positions: int, add_bos: bool) -> dict[str, Any]:
    template = CHAT_TEMPLATE.replace("{% if add_bos %}{{ bos_token }}{% endif %}", "{{ bos_token }}" if add_bos else "")
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        # WHY explicit: some transformers tokenizer classes (Qwen2) add a default unk token.
        "unk_token": None,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "model_max_length": max_positions,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }


def _weight_specs(config: ModelConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF name, shape, init kind) in a fixed order; kind in {embed, linear, out, norm, bias}."""
    h, inter = config.hidden_size, config.intermediate_size
    specs: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (config.vocab_size, h), "embed")]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        specs.append((p + "input_layernorm.weight", (h,), "norm"))
        for proj, rows in (("q", config.q_size), ("k", config.kv_size), ("v", config.kv_size)):
            specs.append((f"{p}self_attn.{proj}_proj.weight", (rows, h), "linear"))
            if config.attention_bias:
                specs.append((f"{p}self_attn.{proj}_proj.bias", (rows,), "bias"))
        specs.append((p + "self_attn.o_proj.weight", (h, config.q_size), "out"))
        if config.attention_out_bias:
            specs.append((p + "self_attn.o_proj.bias", (h,), "bias"))
        if config.qk_norm:
            specs.append((p + "self_attn.q_norm.weight", (config.head_dim,), "norm"))
            specs.append((p + "self_attn.k_norm.weight", (config.head_dim,), "norm"))
        specs.append((p + "post_attention_layernorm.weight", (h,), "norm"))
        specs.append((p + "mlp.gate_proj.weight", (inter, h), "linear"))
        specs.append((p + "mlp.up_proj.weight", (inter, h), "linear"))
        specs.append((p + "mlp.down_proj.weight", (h, inter), "out"))
    specs.append(("model.norm.weight", (h,), "norm"))
    if not config.tie_word_embeddings:
        specs.append(("lm_head.weight", (config.vocab_size, h), "head"))
    return specs


def _family_weight_specs(config: ModelConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF name, shape, init kind) from the model class: its checkpoint names, each resolved to its rows."""
    from trillium.models.registry import model_class

    with torch.device("meta"):
        model = model_class(config.architecture)(config, dtype=torch.float32, max_positions=8)
    params = dict(model.named_parameters())
    specs = []
    for name in model.checkpoint_weight_names():
        param_name, rows = model.resolve_weight(name)
        shape = tuple(params[param_name].shape)
        if rows is not None:
            shape = (rows[1], *shape[1:])
        if name == "model.embed_tokens.weight":
            kind = "embed"
        elif name in ("lm_head.weight", "score.weight"):
            kind = "head"
        elif "norm" in name:
            # Gemma's norms multiply by (1 + w): centre them on 0 instead of 1.
            kind = "norm0" if config.gemma is not None else "norm"
        elif name.endswith(".bias"):
            kind = "bias"
        elif name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):
            kind = "out"
        else:
            kind = "linear"
        specs.append((name, shape, kind))
    return specs


def random_weights(config: ModelConfig, seed: int, dtype: torch.dtype, family: bool = False) -> dict[str, torch.Tensor]:
    """Seeded weights with O(1) activations and logits of std ~2."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape, kind in (_family_weight_specs(config) if family else _weight_specs(config)):
        w = torch.randn(shape, generator=gen, dtype=torch.float32)
        fan_in = shape[-1]
        if kind == "norm0":
            w = 0.1 * w
        elif kind == "norm":
            w = 1.0 + 0.1 * w
        elif kind == "bias":
            w = 0.1 * w
        elif kind == "linear":
            w = w / math.sqrt(fan_in)
        elif kind == "out":
            w = 0.5 * w / math.sqrt(fan_in)
        elif kind == "head":
            w = 2.0 * w / math.sqrt(fan_in)
        elif kind == "embed":
            # Tied models use the embedding as the head too: scale for logits of std ~2.
            w = (2.0 / math.sqrt(fan_in) if config.tie_word_embeddings else 0.5) * w
        out[name] = w.to(dtype).contiguous()
    return out


def _save_weights(path: Path, weights: dict[str, torch.Tensor], shards: int) -> None:
    if shards <= 1:
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(weights)
    per_shard = math.ceil(len(names) / shards)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s * per_shard : (s + 1) * per_shard]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def build_checkpoint(
    path: str | Path,
    variant: str,
    *,
    dtype: str = "float32",
    seed: int = 0,
    sharded: bool = False,
    **config_overrides: Any,
) -> Path:
    """Write the variant's checkpoint into `path` (created if needed); returns the path.

    sharded=True splits the weights over two files plus an index, as large
    HF checkpoints are. config_overrides replace config.json keys (HF names).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config = hf_config_dict(variant, dtype, **config_overrides)
    config = ModelConfig.from_hf_config(hf_config)
    add_bos = variant not in _NO_BOS_VARIANTS
    tokenizer = build_tokenizer(config.vocab_size, add_bos)
    tokenizer.save(str(path / "tokenizer.json"))
    tok_config = _tokenizer_config(config.max_position_embeddings, add_bos)
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    special_map = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
    (path / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, END_ID], "pad_token_id": PAD_ID}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    weights = random_weights(config, seed, torch_dtype(dtype), family=variant in _FAMILY_VARIANTS)
    if config.architecture.endswith("Model"):  # transformers' bare backbone: names without "model."
        weights = {name.removeprefix("model."): tensor for name, tensor in weights.items()}
    _save_weights(path, weights, 2 if sharded else 1)
    return path
