"""GGUF tensors cut per tensor-parallel rank: each rank maps only its rows or blocks of the file.

    rank_piece(tensor, hf_name, shard) -> np.ndarray    this rank's part of a GGUF tensor, still encoded
    check_splits(reader, model_config, size)            ValueError naming a weight whose input-dim split
                                                        does not fall on its quant block boundary

The split itself is `tensor_parallel.TpShard`'s (`TpShard.part`: which dim,
which first index, how many); this module only maps it onto GGUF's layout.
A GGUF tensor in the reader is a read-only memory map: a quantized weight
[rows, K] is `uint8 [rows, K / block * block_bytes]`, one row of blocks per
output row, each block self-contained (its own scales: Q4_0 ... Q8_0 hold 32
weights, the K-quants 256 in a super-block); a float one is [rows, K].

    output rows (dim 0)   any row range: whole rows of blocks (q/k/v, gate/up, embedding, LM head)
    input columns (dim 1) a byte range of every row, whole blocks only: o_proj's H/N*D and
                          down_proj's I/N columns must be a multiple of the block (32 or 256)

Slicing the map before anything is decoded means a rank touches only its
pages; the packed path keeps the sliced blocks as they are (the same C
kernel runs on the shard), the float path dequantizes just the slice.

Q/K rows of the llama architecture are permuted within each head
(gguf_checkpoint.unpermute_rows); a rank's rows are whole heads, so the
caller un-permutes the slice by its own head count, which gives exactly the
rows of the un-permuted full tensor.

INVARIANT: a split that cannot fall on a block boundary is refused at start
(`check_splits`, from distributed/tp_checks.py) and again here, never
dequantized across a block and never served wrong.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Weights cut on their input dim (row-parallel): GGUF tensor suffix -> what its per-rank width is.
_COLUMN_SPLIT = {"attn_output.weight": "heads", "ffn_down.weight": "inter"}


def _block(ggml_type: int) -> tuple[int, int]:
    """(weights per block, bytes per block); (1, item bytes) for F32 / F16 / BF16."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]


def _refuse_unaligned(gguf_name: str, ggml_type: int, cols: int, first: int, count: int) -> None:
    per_block = _block(ggml_type)[0]
    if first % per_block or count % per_block:
        from gguf.constants import GGMLQuantizationType

        kind = GGMLQuantizationType(ggml_type).name
        raise ValueError(
            f"GGUF tensor {gguf_name} ({kind}, {cols} input columns) cannot be split over tensor-parallel "
            f"ranks: each rank's {count} columns are not whole {kind} blocks of {per_block}; "
            "choose a --tensor-parallel-size whose slice is a multiple of the block, or serve a "
            "safetensors checkpoint")


def check_splits(reader: Any, model_config: Any, size: int) -> None:
    """ValueError for the first input-dim split (o_proj, down_proj) that does not fall on a block boundary."""
    if size == 1:
        return
    widths = {"heads": model_config.num_heads // size * model_config.head_dim,
              "inter": model_config.intermediate_size // size}
    for tensor in reader.tensors:
        suffix = next((s for s in _COLUMN_SPLIT if tensor.name.endswith("." + s)), None)
        if suffix is None or len(tensor.shape) != 2:
            continue
        width = widths[_COLUMN_SPLIT[suffix]]
        _refuse_unaligned(tensor.name, int(tensor.tensor_type), int(tensor.shape[0]), width, width)


def rank_piece(tensor: Any, hf_name: str, shard: Any) -> np.ndarray:
    """This rank's part of `tensor.data` in the file's own encoding (blocks or floats), not yet un-permuted.

    Rows past the end (the vocabulary's last rank) are zero, which every GGUF format decodes to 0.0.
    """
    data = tensor.data
    part = shard.part(hf_name)
    if part is None:
        return data
    dim, first, count = part
    if dim is None:  # a row-parallel layer's bias: counted once, on rank 0
        return data if shard.rank == 0 else np.zeros_like(data)
    if dim == 0:
        piece = data[first: min(first + count, data.shape[0])]
        if piece.shape[0] < count:
            pad = np.zeros((count - piece.shape[0], *data.shape[1:]), dtype=data.dtype)
            piece = np.concatenate([piece, pad])
        return piece
    cols = int(tensor.shape[0])  # GGUF lists dims innermost first
    _refuse_unaligned(tensor.name, int(tensor.tensor_type), cols, first, count)
    per_block, block_bytes = _block(int(tensor.tensor_type))
    if data.dtype != np.uint8:  # F32 / F16: columns are elements (BF16 and the quants come as bytes)
        return data[:, first: first + count]
    return data[:, first // per_block * block_bytes: (first + count) // per_block * block_bytes]
