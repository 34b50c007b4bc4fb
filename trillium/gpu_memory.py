"""vLLM's --gpu-memory-utilization: the KV cache from a fraction of the device's memory.

    kv_budget_from_utilization(engine_config, model_config, dtype) -> bytes for the KV cache

vLLM gives one instance `utilization x total device memory` for everything:
weights, activations and the KV cache, which gets what the other two leave
(vllm/engine/arg_utils.py `gpu_memory_utilization`, default 0.9; vLLM
measures the activation peak with a profiling run). Trillium sizes the KV
cache in the api process before any actor starts, so every process agrees
on the block count: it counts the checkpoint's weights (safetensors headers
or GGUF tensor shapes, in the serving dtype) and reserves an estimate of
the activation peak (one step of --max-num-batched-tokens through the
widest layer, the logits of --max-num-seqs rows, and 512 MiB for the CUDA
context and allocator slack). The numbers are logged at start.
"""

from __future__ import annotations

import json
import logging
import math
import struct

log = logging.getLogger(__name__)

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_CONTEXT_RESERVE_BYTES = 512 * 2**20


def _safetensors_numel(files) -> int:
    total = 0
    for file in files:
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def checkpoint_numel(path: str) -> int:
    """Number of weight elements of the checkpoint at `path` (no weights read)."""
    from trillium.models.checkpoint_files import find_gguf_file, safetensors_files

    gguf = find_gguf_file(path)
    if gguf is not None:
        from trillium.models.gguf_checkpoint import open_gguf

        return sum(int(t.n_elements) for t in open_gguf(gguf).tensors)
    return _safetensors_numel(safetensors_files(path))


def activation_reserve_bytes(engine_config, model_config, dtype: str) -> int:
    width = max(model_config.hidden_size * 4, model_config.intermediate_size * 2)
    step = engine_config.max_num_batched_tokens * width * _BYTES[dtype] * 2
    logits = engine_config.max_num_seqs * model_config.vocab_size * 4 * 2  # float32, sampled twice
    return step + logits + _CONTEXT_RESERVE_BYTES


def kv_budget_from_utilization(engine_config, model_config, dtype: str) -> int:
    import torch

    total = torch.cuda.get_device_properties(torch.device(engine_config.device)).total_memory
    allowed = int(total * engine_config.gpu_memory_utilization)
    weights = checkpoint_numel(engine_config.model) * _BYTES[dtype]
    reserve = activation_reserve_bytes(engine_config, model_config, dtype)
    budget = allowed - weights - reserve
    log.info("--gpu-memory-utilization %.2f of %.1f GiB = %.1f GiB: weights %.2f GiB, activation reserve "
             "%.2f GiB, KV cache %.2f GiB", engine_config.gpu_memory_utilization, total / 2**30, allowed / 2**30,
             weights / 2**30, reserve / 2**30, max(budget, 0) / 2**30)
    if budget <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {engine_config.gpu_memory_utilization}: {allowed / 2**30:.1f} GiB "
            f"does not hold the weights ({weights / 2**30:.2f} GiB) and activations ({reserve / 2**30:.2f} GiB); "
            "raise it or give --kv-cache-memory")
    return budget
