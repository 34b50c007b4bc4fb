"""Read llama.cpp GGUF checkpoints as HF-named float tensors.

GGUF stores llama.cpp names (`blk.N.attn_q.weight`), quantized blocks and,
for the `llama` architecture, Q/K rows permuted from HF's rotate-half rope
layout to llama.cpp's interleaved-pair layout. This module undoes all three
exactly as transformers' GGUF loader does (`load_gguf_checkpoint` with its
`LlamaTensorProcessor`, behind `from_pretrained(dir, gguf_file=...)`):

    dequantize (gguf.quants.dequantize, float32)
    -> un-permute attn_q / attn_k rows (llama arch only; qwen2/3 are not permuted)
    -> rename to HF names (`model.layers.N.self_attn.q_proj.weight`)

Mixture-of-experts files (qwen2moe, qwen3moe, Mixtral as `llama` with
`expert_count`) stack each layer's experts into `ffn_{gate,up,down}_exps`
[E, rows, cols]; they are yielded per expert under the Hub's names
(`mlp.experts.N.gate_proj.weight`, Mixtral `block_sparse_moe.experts.N.w1.weight`),
the shared expert's gate `ffn_gate_inp_shexp` [H] as [1, H] (as transformers'
`Qwen2MoeTensorProcessor`). Phi-3's `attn_qkv` and `ffn_up` are already the
fused qkv_proj / gate_up_proj.

Gemma 2 / Gemma 3 (`gemma2`, `gemma3`): llama.cpp's converter stores every
`*norm.weight` plus 1 (its RMSNorm multiplies by the stored weight, HF's by
1 + weight); 1 is subtracted back, as transformers' `Gemma2TensorProcessor`.
Their four norms are `attn_norm`, `post_attention_norm`, `ffn_norm` (the
*pre*-feedforward norm there) and `post_ffw_norm`.

With `packed_types` (ggml type ids, e.g. Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K), `iter_weights`
yields 2-D weights of those types as `PackedTensor`s (the raw blocks, rows
un-permuted, nothing dequantized) for `packed_linear.install_packed`; a
tied `token_embd` is then yielded twice: dequantized as the embedding and
packed as `lm_head.weight`.

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
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from trillium.models.config import ModelConfig
from trillium.models.config_families import GEMMA_ARCHITECTURES, MOE_ARCHITECTURES

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
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Stacked experts -> the per-expert Hub name (format: expert index), per naming scheme.
_EXPERT_NAMES = {
    "qwen": {"ffn_gate_exps": "mlp.experts.{}.gate_proj", "ffn_up_exps": "mlp.experts.{}.up_proj",
             "ffn_down_exps": "mlp.experts.{}.down_proj"},
    "mixtral": {"ffn_gate_exps": "block_sparse_moe.experts.{}.w1", "ffn_up_exps": "block_sparse_moe.experts.{}.w3",
                "ffn_down_exps": "block_sparse_moe.experts.{}.w2"},
}  # fmt: skip
# Gemma's norm names where they differ from the Llama family's (gguf-py TensorNameMap, MODEL_ARCH.GEMMA2/3).
_GEMMA_BLOCK_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_NORM_SHIFTED_ARCHS = ("gemma2", "gemma3")  # converter wrote norm weights + 1
_ROPE_FREQS = "rope_freqs.weight"
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
# Architectures whose converter permuted Q/K rows (llama.cpp convert_hf_to_gguf `LlamaModel`).
_PERMUTED_ARCHS = ("llama", "mistral")


@attrs.frozen(eq=False)
class PackedTensor:
    """One GGUF weight [rows, K], still in llama.cpp blocks (one row of blocks per output row)."""

    blocks: torch.Tensor  # uint8 [rows, K / 32 * block bytes]
    ggml_type: int
    shape: tuple[int, int]

    @property
    def format_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, K], exactly as the float path (gguf.quants.dequantize)."""
        return torch.from_numpy(np.ascontiguousarray(dequantize(self.blocks.numpy(), self.ggml_type)))


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


def hf_name(gguf_name: str, architecture: str = "LlamaForCausalLM") -> str | None:
    """HF weight name for a llama.cpp tensor name; None for tensors with no HF weight.

    Stacked expert tensors name a format string (`{}`: the expert index).
    """
    if gguf_name == _ROPE_FREQS:
        return None
    base, _, kind = gguf_name.rpartition(".")
    if base in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk":
        block = _BLOCK_NAMES.get(parts[2])
        if architecture in GEMMA_ARCHITECTURES:
            block = _GEMMA_BLOCK_NAMES.get(parts[2], block)
        if parts[2] == "ffn_up" and architecture == "Phi3ForCausalLM":
            block = "mlp.gate_up_proj"  # llama.cpp keeps Phi-3's fused gate/up under ffn_up
        if parts[2] == "ffn_gate_inp" and architecture == "MixtralForCausalLM":
            block = "block_sparse_moe.gate"
        if parts[2] in _EXPERT_NAMES["qwen"] and architecture in MOE_ARCHITECTURES:
            scheme = "mixtral" if architecture == "MixtralForCausalLM" else "qwen"
            block = _EXPERT_NAMES[scheme][parts[2]]
        if block is not None:
            return f"model.layers.{parts[1]}.{block}.{kind}"
    raise KeyError(f"GGUF tensor {gguf_name!r} has no Llama-family equivalent")


def unpermute_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permute: per head, interleaved pairs back to [first half | second half].

    Same reshape/swap as transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _is_stacked(name: str) -> bool:
    return "_exps." in name


def num_weight_tensors(reader: GGUFReader) -> int:
    """HF tensors the file yields (a stacked expert tensor counts once per expert)."""
    return sum(int(t.shape[-1]) if _is_stacked(t.name) else 1 for t in reader.tensors if t.name != _ROPE_FREQS)


def iter_weights(
    reader: GGUFReader,
    config: ModelConfig,
    packed_types: frozenset[int] = frozenset(),
    dequantized: dict[str, str] | None = None,
    shard: Any = None,
) -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
    """(HF name, float tensor) for every weight in the file, dequantized and un-permuted;
    2-D weights whose type is in `packed_types` come as `PackedTensor` instead.

    With packing on, `dequantized` collects the quantized weights that still come as floats, and why.
    `shard` (a tensor-parallel `TpShard`): each tensor is this rank's slice, cut from the file's
    blocks before anything is decoded (gguf_tensor_parallel.py).
    """
    if shard is not None:
        from trillium.models.gguf_tensor_parallel import rank_piece
    arch = reader.fields["general.architecture"].contents()
    permuted = arch in _PERMUTED_ARCHS
    norm_shifted = arch in _NORM_SHIFTED_ARCHS
    for tensor in reader.tensors:
        name = hf_name(tensor.name, config.architecture)
        if name is None:
            continue
        kind = GGMLQuantizationType(int(tensor.tensor_type))
        packable = kind in packed_types and len(tensor.shape) == 2 and not _is_stacked(tensor.name)
        data = tensor.data if shard is None else rank_piece(tensor, name, shard)
        if packable:
            packed = _packed(tensor, data, config, permuted)
            if tensor.name != "token_embd.weight":
                yield name, packed
                continue
            if config.tie_word_embeddings:
                yield "lm_head.weight", packed
        if packed_types and dequantized is not None and kind not in _FLOAT_TYPES:
            dequantized[name] = f"{kind.name} {'embedding lookup' if packable else 'no packed kernel'}"
        weights = dequantize(data, tensor.tensor_type)
        if _is_stacked(tensor.name):
            for expert in range(weights.shape[0]):
                yield name.format(expert), torch.from_numpy(np.array(weights[expert]))  # a copy: the map is read-only
            continue
        if tensor.name.endswith("ffn_gate_inp_shexp.weight") and weights.ndim == 1:
            weights = weights[None, :]
        weights = _unpermute(tensor.name, weights, config, permuted)
        if norm_shifted and tensor.name.endswith("norm.weight"):
            # NOTE: for stored values in [0.5, 2] (Sterbenz) a - 1 is exact, so GemmaRMSNorm's 1 + w is a again.
            weights = weights - np.float32(1.0)
        if not weights.flags.writeable:  # float tensors come back as views of the read-only map
            weights = weights.copy()
        yield name, torch.from_numpy(np.ascontiguousarray(weights))


def _unpermute(gguf_name: str, rows: np.ndarray, config: ModelConfig, permuted: bool) -> np.ndarray:
    """NOTE: the permute is within each head, so the head count is the rows' (a tensor-parallel
    rank's slice holds whole heads: un-permuting it gives its rows of the un-permuted tensor)."""
    if permuted and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
        return unpermute_rows(rows, rows.shape[0] // config.head_dim)
    return rows


def _packed(tensor: Any, data: np.ndarray, config: ModelConfig, permuted: bool) -> PackedTensor:
    """`data`'s blocks [rows, row bytes] (the tensor's, or a rank's slice) as a torch copy,
    rows un-permuted like the floats."""
    blocks = _unpermute(tensor.name, np.asarray(data), config, permuted)
    cols = int(tensor.shape[0]) * blocks.shape[1] // np.asarray(tensor.data).shape[1]  # a slice's share of K
    return PackedTensor(torch.from_numpy(np.array(blocks, dtype=np.uint8)), int(tensor.tensor_type),
                        (blocks.shape[0], cols))
