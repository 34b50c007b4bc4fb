"""What runs under tensor parallelism, checked at start (pure; no torch).

    refuse_engine(config)            ValueError naming every feature that does not run under TP
    refuse_model(config, model_cfg)  the same for the checkpoint (family, head counts, GGUF blocks)

Under `--tensor-parallel-size N > 1` the dense Llama family (Llama, Mistral,
Qwen2, Qwen3: GQA, tied embeddings, qkv bias, q/k norm) is sharded over N
executor ranks, LoRA adapters with it (lora/tensor_parallel.py). An fp8 KV
cache needs nothing more: each rank quantizes its own KV heads, with its own
per-layer scales calibrated from them (models/kv_cache.py). The host KV tier
neither: the scheduler keeps one index (block ids and host slots are the same
on every rank), every rank receives the same KvTransfers in its ExecuteBatch
and copies its own shard of each block (executor/host_kv.py holds this
rank's heads; --kv-host-bytes is per rank, like --kv-cache-memory). GGUF
files shard too (models/gguf_tensor_parallel.py: rows and whole quant blocks,
read per rank) when each rank's o_proj / down_proj columns are whole blocks
(32 weights; 256 for the K-quants). What is not
sharded is refused here, before anything starts, never served wrong: a
feature is either split correctly or named.
"""

from __future__ import annotations

# Architectures whose weights `models/tensor_parallel.py` knows how to split.
TP_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def refuse_engine(config) -> None:
    """ValueError listing the flags that do not run with config.tensor_parallel_size > 1."""
    size = config.tensor_parallel_size
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {size}")
    nnodes = config.tp_nnodes
    if nnodes < 1 or size % nnodes:
        raise ValueError(f"--nnodes {nnodes}: --tensor-parallel-size {size} must be a multiple of it")
    if size == 1:
        return
    if config.tp_collective_timeout_s <= 0:
        raise ValueError(f"--tp-collective-timeout-s must be > 0, got {config.tp_collective_timeout_s}")
    refused = [
        (config.runner == "pooling", "--runner pooling (embedding / classification models)"),
        (config.gpu_memory_utilization > 0, "--gpu-memory-utilization (give --kv-cache-memory per rank)"),
    ]
    names = [name for flag, name in refused if flag]
    if names:
        raise ValueError(f"--tensor-parallel-size {size}: not supported together with {', '.join(names)}; "
                         "run these with --tensor-parallel-size 1")


def refuse_model(config, model_config, is_gguf: bool) -> None:
    """ValueError when the checkpoint cannot be split over config.tensor_parallel_size ranks."""
    size = config.tensor_parallel_size
    if size == 1:
        return
    if model_config.architecture not in TP_ARCHITECTURES:
        raise ValueError(f"--tensor-parallel-size {size}: {model_config.architecture} is not sharded "
                         f"(MoE, Gemma and Phi-3 run on one rank); sharded: {', '.join(TP_ARCHITECTURES)}")
    h, kh, inter = model_config.num_heads, model_config.num_kv_heads, model_config.intermediate_size
    why = None
    if h % size:
        why = f"its {h} attention heads do not split over {size} ranks"
    elif kh % size and size % kh:
        why = f"its {kh} KV heads neither split over {size} ranks nor replicate evenly on them"
    elif inter % size:
        why = f"its MLP width {inter} does not split over {size} ranks"
    if why:
        raise ValueError(f"--tensor-parallel-size {size}: {model_config.architecture} cannot be sharded: {why}")
    if is_gguf:
        _refuse_gguf_blocks(config, model_config)


def _refuse_gguf_blocks(config, model_config) -> None:
    """A GGUF o_proj / down_proj is cut on its input dim: each rank's columns must be whole quant blocks."""
    from trillium.models.checkpoint_files import find_gguf_file
    from gguf import GGUFReader
    from trillium.models.gguf_tensor_parallel import check_splits

    size = config.tensor_parallel_size
    try:
        check_splits(GGUFReader(str(find_gguf_file(config.model))), model_config, size)
    except ValueError as exc:
        raise ValueError(f"--tensor-parallel-size {size}: {exc}") from None


def local_kv_model_config(model_config, size: int):
    """The ModelConfig whose KV block bytes are one rank's (its KV heads); the same one at size 1."""
    import attrs

    if size == 1:
        return model_config
    return attrs.evolve(model_config, num_kv_heads=max(1, model_config.num_kv_heads // size))
