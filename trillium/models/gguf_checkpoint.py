"""Read llama.cpp GGUF checkpoints as HF-named float tensors.

GGUF stores llama.cpp names (`blk.N.attn_q.weight`), quantized blocks and,
for the `llama` architecture, Q/K rows permuted from HF's rotate-half rope
layout to llama.cpp's interleaved-pair layout. This module undoes all three
exactly as transformers' GGUF loader does (`load_gguf_checkpoint` with its
`LlamaTensorProcessor`, behind `from_pretrained(dir, gguf_file=...)`):

    dequantize (gguf.quants.dequantize, float32)
    -> un-permute attn_q / attn_k rows (llama arch only; qwen2/3 are not permuted)
    -> rename to HF names (`model.layers.N.self_attn.q_proj.weight`)

Where transformers ignores `rope_freqs.weight` (Llama 3.1 style per-frequency
rope divisors), this module reads it into `rope_scaling`, as llama.cpp
applies it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import attrs
import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from trillium.models.config import ModelConfig

# Large tokenizer arrays the model config never needs.
_SKIPPED_FIELDS = ("tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ROPE_FREQS = "rope_freqs.weight"
# Architectures whose converter permuted Q/K rows (llama.cpp convert_hf_to_gguf `LlamaModel`).
_PERMUTED_ARCHS = ("llama", "mistral")


def open_gguf(path: str | Path) -> GGUFReader:
    return GGUFReader(str(path))


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/values as Python values, except the big tokenizer arrays."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in _SKIPPED_FIELDS or key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def read_config(reader: GGUFReader) -> ModelConfig:
    names = {t.name for t in reader.tensors}
    config = ModelConfig.from_gguf_metadata(read_metadata(reader), names)
    if _ROPE_FREQS in names:
        tensor = next(t for t in reader.tensors if t.name == _ROPE_FREQS)
        factors = dequantize(tensor.data, tensor.tensor_type).reshape(-1)
        rope_scaling = {"rope_type": "freq_factors", "freq_factors": [float(f) for f in factors]}
        config = attrs.evolve(config, rope_scaling=rope_scaling)
    return config


def hf_name(gguf_name: str) -> str | None:
    """HF weight name for a llama.cpp tensor name; None for tensors with no HF weight."""
    if gguf_name == _ROPE_FREQS:
        return None
    base, _, kind = gguf_name.rpartition(".")
    if base in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{kind}"
    raise KeyError(f"GGUF tensor {gguf_name!r} has no Llama-family equivalent")


def unpermute_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permute: per head, interleaved pairs back to [first half | second half].

    Same reshape/swap as transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def num_weight_tensors(reader: GGUFReader) -> int:
    return sum(1 for t in reader.tensors if t.name != _ROPE_FREQS)


def iter_weights(reader: GGUFReader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float tensor) for every weight in the file, dequantized and un-permuted."""
    arch = reader.fields["general.architecture"].contents()
    permuted = arch in _PERMUTED_ARCHS
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)
        if permuted and ".attn_q." in tensor.name:
            weights = unpermute_rows(weights, config.num_heads)
        elif permuted and ".attn_k." in tensor.name:
            weights = unpermute_rows(weights, config.num_kv_heads)
        if not weights.flags.writeable:  # float tensors come back as views of the read-only map
            weights = weights.copy()
        yield name, torch.from_numpy(np.ascontiguousarray(weights))
