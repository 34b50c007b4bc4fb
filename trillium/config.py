"""The one configuration tree, built once at start-up and passed down.

`EngineConfig` is frozen; `EngineConfig.resolve(...)` reads the model's
config (cheap: config.json or GGUF metadata, no weights) to fill in
max_model_len and the number of KV blocks, so every process that receives
the config agrees on them. Actors get it as bytes (`to_bytes` /
`from_bytes`, JSON through cattrs: no pickle).
"""

from __future__ import annotations

import json
import os
import re

import attrs
import cattrs

_converter = cattrs.Converter()

DEFAULT_KV_CACHE_MEMORY = "512MiB"


def parse_memory(value: str | int | float, total_bytes: int | None = None) -> int:
    """'512MiB', '2GB', '1073741824' or '10%' (of total_bytes) -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    text = value.strip()
    if text.endswith("%"):
        if total_bytes is None:
            raise ValueError(f"a percentage ({text}) needs a known total memory")
        return int(total_bytes * float(text[:-1]) / 100)
    m = re.fullmatch(r"([0-9.]+)\s*([KMGT]i?B?|B)?", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse memory size {value!r} (try 512MiB, 2GB, 10%)")
    number, unit = float(m.group(1)), (m.group(2) or "B").upper()
    scale = {"B": 1, "K": 1e3, "KB": 1e3, "KIB": 2**10, "M": 1e6, "MB": 1e6, "MIB": 2**20,
             "G": 1e9, "GB": 1e9, "GIB": 2**30, "T": 1e12, "TB": 1e12, "TIB": 2**40}[unit]
    return int(number * scale)


@attrs.frozen
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    kv_cache_memory: str = DEFAULT_KV_CACHE_MEMORY
    num_blocks: int = 0  # resolved from kv_cache_memory
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # fcfs | priority
    seed: int = 0
    served_model_name: str = ""
    num_threads: int = 0  # torch intra-op threads in the executor; 0 = torch default
    # Multi-LoRA (trillium/lora/): adapters resident on the device at once (the most
    # distinct adapters one step serves), their largest rank, and the host cache size.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 0  # 0: max_loras
    # OTLP/HTTP traces endpoint (e.g. http://127.0.0.1:4318/v1/traces); None: no tracing.
    # Every process that traces exports there itself (observability/tracing.py).
    otlp_traces_endpoint: str | None = None
    collect_detailed_traces: bool = False  # the actors' stage spans too (the api's initial setting)

    def __attrs_post_init__(self) -> None:
        if self.enable_lora and (self.max_loras < 1 or self.max_lora_rank < 1 or self.max_cpu_loras < 0):
            raise ValueError("--max-loras and --max-lora-rank must be >= 1 (and --max-cpu-loras >= 0)")
        if self.collect_detailed_traces and not self.otlp_traces_endpoint:
            raise ValueError("--collect-detailed-traces needs --otlp-traces-endpoint")

    def to_bytes(self) -> bytes:
        return json.dumps(_converter.unstructure(self)).encode()

    @staticmethod
    def from_bytes(data: bytes) -> "EngineConfig":
        return _converter.structure(json.loads(data), EngineConfig)

    def resolve(self) -> "EngineConfig":
        """Fill max_model_len, num_blocks, dtype and served_model_name from the model."""
        from trillium.models.loader import load_model_config
        from trillium.models.llama import kv_cache_block_bytes

        model_config = load_model_config(self.model)
        dtype = self.dtype if self.dtype != "auto" else _auto_dtype(model_config, self.device)
        max_len = self.max_model_len or model_config.max_position_embeddings
        if max_len > model_config.max_position_embeddings:
            raise ValueError(
                f"--max-model-len {max_len} exceeds the model's context "
                f"({model_config.max_position_embeddings})"
            )
        budget = parse_memory(self.kv_cache_memory, _device_memory_bytes(self.device))
        per_block = kv_cache_block_bytes(model_config, self.block_size, dtype)
        num_blocks = self.num_blocks or budget // per_block
        if num_blocks < 2:
            raise ValueError(
                f"--kv-cache-memory {self.kv_cache_memory} holds {num_blocks} blocks "
                f"({per_block} bytes each); need at least 2"
            )
        name = self.served_model_name or _default_served_name(self.model)
        return attrs.evolve(
            self, dtype=dtype, max_model_len=max_len, num_blocks=int(num_blocks),
            served_model_name=name,
        )

    @property
    def num_kv_tokens(self) -> int:
        return self.num_blocks * self.block_size


def _default_served_name(model: str) -> str:
    """The model's file or directory name, without a .gguf suffix."""
    name = os.path.basename(os.path.normpath(model))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def _auto_dtype(model_config, device: str) -> str:
    # WHY: bf16/fp16 matmuls on CPU are slow and lossy; serve float32 there.
    if not device.startswith("cuda"):
        return "float32"
    return model_config.dtype if model_config.dtype in ("bfloat16", "float16") else "bfloat16"


def _device_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
