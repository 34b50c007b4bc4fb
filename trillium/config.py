"""The one configuration tree, built once at start-up and passed down.

`EngineConfig` is frozen; `EngineConfig.resolve(...)` reads the model's
config (cheap: config.json or GGUF metadata, no weights) to fill in
max_model_len and the number of KV blocks, so every process that receives
the config agrees on them. Actors get it as bytes (`to_bytes` /
`from_bytes`, JSON through cattrs: no pickle).
"""

from __future__ import annotations

import json
import logging
import os
import re

import attrs
import cattrs

from trillium.sampling_params import MAX_STREAM_INTERVAL
from trillium.speculative.config import SpeculativeConfig, draft_kv_block_bytes, parse_speculative_config

log = logging.getLogger(__name__)

_converter = cattrs.Converter()

DEFAULT_KV_CACHE_MEMORY = "512MiB"
# --quantization values (vLLM's names) Trillium implements; None: from the checkpoint.
SUPPORTED_QUANTIZATION = (None, "gguf", "awq", "gptq")
# --kv-cache-dtype values; a resolved config holds one of the last five (models/kv_cache.py).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "float32", "bfloat16", "float16")


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


# Flat engine arguments (CLI flags, LLM(**kwargs)) -> KvTierConfig fields.
KV_TIER_ARGS = {
    "kv_host_bytes": "host_bytes", "kv_eviction_policy": "eviction_policy", "num_host_blocks": "num_host_blocks",
    "kv_disk_path": "disk_path", "kv_disk_bytes": "disk_bytes", "num_disk_blocks": "num_disk_blocks",
}


@attrs.frozen
class KvTierConfig:
    """The KV tiers under the device cache (actors/kv_tiers/manager.py).

    Host tier (kv_tiers/host.py): prefix-cache blocks the device evicts spill
    to host memory (pinned on CUDA) and load back on a hit; 0 bytes = off.
    Needs prefix caching. Disk tier (kv_tiers/disk.py): host-tier evictions
    spill to files under `disk_path` (one per block, content-hashed), up to
    `disk_bytes`; they survive a restart of the same model. Needs the host tier.
    """

    host_bytes: int = attrs.field(default=0, converter=parse_memory)  # --kv-host-bytes
    eviction_policy: str = "lru"  # --kv-eviction-policy lru | arc: which host block leaves first
    num_host_blocks: int = 0  # resolved from host_bytes
    disk_path: str = ""  # --kv-disk-path
    disk_bytes: int = attrs.field(default=0, converter=parse_memory)  # --kv-disk-bytes
    num_disk_blocks: int = 0  # resolved from disk_bytes
    disk_model_fingerprint: str = ""  # resolved: which model's KV the files hold

    @property
    def has_host(self) -> bool:
        return bool(self.host_bytes or self.num_host_blocks)

    def check(self, enable_prefix_caching: bool) -> None:
        from trillium.actors.kv_tiers.policies import POLICIES

        if self.host_bytes < 0 or self.num_host_blocks < 0:
            raise ValueError("--kv-host-bytes must be >= 0")
        if self.has_host and not enable_prefix_caching:
            raise ValueError("--kv-host-bytes needs prefix caching: the host tier is keyed by block hashes")
        if self.disk_path and not self.has_host:
            raise ValueError("--kv-disk-path needs --kv-host-bytes: disk blocks are read into the host tier")
        if self.disk_path and not (self.disk_bytes > 0 or self.num_disk_blocks > 0):
            raise ValueError("--kv-disk-path needs --kv-disk-bytes (how much disk the tier may use, e.g. 20GiB)")
        if self.disk_bytes and not self.disk_path:
            raise ValueError("--kv-disk-bytes needs --kv-disk-path")
        if self.eviction_policy not in POLICIES:
            raise ValueError(f"--kv-eviction-policy must be one of {sorted(POLICIES)}, got {self.eviction_policy!r}")

    def resolve(self, per_block: int, fingerprint) -> "KvTierConfig":
        """Block counts from the byte sizes (`per_block`: one KV block); the
        disk directory checked now. `fingerprint()` names the model's KV."""
        num_host_blocks = self.num_host_blocks or self.host_bytes // per_block
        if self.host_bytes and num_host_blocks < 1:
            raise ValueError(f"--kv-host-bytes {self.host_bytes} holds no {per_block}-byte KV block")
        if not self.disk_path:
            return attrs.evolve(self, num_host_blocks=int(num_host_blocks))
        num_disk_blocks = self.num_disk_blocks or self.disk_bytes // per_block
        if num_disk_blocks < 1:
            raise ValueError(f"--kv-disk-bytes {self.disk_bytes} holds no {per_block}-byte KV block")
        try:  # WHY here: a clear error at start, not a warning per block later
            os.makedirs(self.disk_path, exist_ok=True)
            if not os.access(self.disk_path, os.W_OK | os.X_OK):
                raise PermissionError(f"no write access to {self.disk_path}")
        except OSError as exc:
            raise ValueError(f"--kv-disk-path {self.disk_path!r} is not a writable directory: {exc}") from exc
        return attrs.evolve(self, num_host_blocks=int(num_host_blocks), num_disk_blocks=int(num_disk_blocks),
                            disk_model_fingerprint=fingerprint())


# Compiled decode's default sizes: up to 64 rows, the default --max-num-seqs (decode steps of 9-64
# sequences ran eager with 1,2,4,8; compiling them too gave 1.03x at 64 requests at once, README).
DEFAULT_COMPILE_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


def default_compile_batch_sizes(max_rows: int) -> tuple[int, ...]:
    """DEFAULT_COMPILE_BATCH_SIZES up to the first size that holds `max_rows` (all of them past 64)."""
    sizes = []
    for size in DEFAULT_COMPILE_BATCH_SIZES:
        sizes.append(size)
        if size >= max_rows:
            break
    return tuple(sizes)


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
    # auto (the model dtype) | fp8_e4m3 | fp8_e5m2 (fp8 = fp8_e4m3); resolved to a dtype name.
    # fp8 halves the KV bytes per token of bf16: twice the tokens in the same kv_cache_memory.
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    # The host and disk KV tiers under the device cache (KvTierConfig below); off by default.
    kv_tiers: KvTierConfig = attrs.field(factory=lambda: KvTierConfig())
    # What a preempted request's KV becomes (actors/scheduler/preemption.py): recompute
    # (dropped; recomputed when re-admitted) | swap (copied to the host tier and back; needs it).
    preemption_mode: str = "recompute"
    # Sleep level 1 keeps the prefix cache: the device's cached blocks spill to the host
    # tier before the KV cache is freed, and hit again after the wake. Needs the host tier.
    sleep_keep_prefix_cache: bool = False
    kv_block_bytes: int = 0  # resolved: one KV block across all layers
    # resolved: the sliding window every attention layer of the model shares (Mistral-style), whose
    # KV blocks behind it the scheduler frees (kv_tiers/block_pool.py); 0: full attention or hybrid.
    kv_sliding_window: int = 0
    vocab_size: int = 0  # resolved from the model (the scheduler checks token ids against it); 0: unknown
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
    # vLLM compatibility (cli_compat.py). tokenizer: a local folder ("" = the model's).
    tokenizer: str = ""
    # > 0 on CUDA: the KV cache is what this fraction of the device leaves after the
    # weights and an activation reserve (vLLM's --gpu-memory-utilization); 0: kv_cache_memory.
    gpu_memory_utilization: float = 0.0
    # Default sampling params (generation_defaults.py): auto | vllm | a folder; JSON overrides.
    generation_config: str = "auto"
    override_generation_config: str = ""
    max_queue_time_s: float = 0.0  # --max-queue-time-s: waiting requests that never ran get 503 after it; 0: off
    # Pooling models (trillium/pooling/config.py): --runner auto | generate | pooling (resolved to
    # one of the last two), --convert auto | embed | classify | reward, --pooler-config JSON
    # (resolved: the PoolerConfig's JSON; "" for generate).
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: str = ""
    # Weight quantization, vLLM's --quantization names: None (from the checkpoint: a .gguf is "gguf", an
    # AWQ/GPTQ directory its config.json quant_method) | "gguf" | "awq" | "gptq" (must match the checkpoint).
    quantization: str | None = None
    # GGUF: dequantize every weight to float at load instead of keeping Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K packed.
    gguf_dequantize: bool = False
    # GGUF packed projections, decode-sized batches: "int8" (activations quantized to int8 blocks, integer
    # dots: llama.cpp's and vLLM's GGUF numerics) or "float32" (exact dequantize-then-matmul);
    # None: int8. Given for a model that is not a .gguf, or with gguf_dequantize, it is refused.
    gguf_activations: str | None = None
    # Tensor parallelism (distributed/tp_checks.py, models/tensor_parallel.py): executor ranks; the
    # loopback port of their TCPStore (0: the server picks a free one, assembly.py); how long a
    # collective may wait for a rank before it is an error.
    tensor_parallel_size: int = 1
    tp_master_port: int = 0
    # More than one host (distributed/nodes.py): the ranks spread evenly over tp_nnodes hosts; rank 0
    # (on the head node) binds the store on tp_master_addr, which every rank reaches (vLLM's --master-addr).
    tp_master_addr: str = "127.0.0.1"
    tp_nnodes: int = 1
    tp_collective_timeout_s: float = 60.0
    # Compiled decode (actors/executor/compiled_decode.py): pure-decode steps of up to
    # max(compile_batch_sizes) sequences run a torch.compile graph padded to the next size.
    # None resolves to DEFAULT_COMPILE_BATCH_SIZES up to the first that holds a full step (max_num_seqs
    # rows, times 1 + the drafts of a verify step), so a small --max-num-seqs compiles no size it cannot use.
    # enforce_eager None resolves from TRILLIUM_ENFORCE_EAGER (1: eager; the test suite sets it), else False.
    enforce_eager: bool | None = None
    compile_batch_sizes: tuple[int, ...] | None = None
    # Set by resolve() when it filled compile_batch_sizes with the defaults (it stays set on a second
    # resolve). With the defaults, an executor whose native decode takes every decode step (the plain
    # Llama family, float32 KV cache, no speculation: models/native_decode.py) compiles no graph.
    compile_batch_sizes_defaulted: bool = False
    # Buckets up to this size compile with Inductor's C++ wrapper (no Python between the graph's ops:
    # ~0.4 ms a step; its C++ takes 70-90 s a bucket to build cold for SmolLM2 on 2 cores), larger ones
    # with its Python wrapper (a step long enough that the 0.4 ms is ~1-4%). 0: the Python wrapper everywhere.
    compile_cpp_wrapper_max_batch: int = 4
    # Speculative decoding (trillium/speculative/): vLLM's --speculative-config, parsed in `build`.
    speculative_config: SpeculativeConfig = attrs.field(factory=SpeculativeConfig)
    # vLLM's --async-scheduling (actors/scheduler/in_flight.py): the scheduler plans step N+1 while
    # step N runs. None (unset) resolves, as vLLM's does, to on where supported, here while at most
    # ASYNC_AUTO_MAX_RUNNING requests run (async_max_running); True plans ahead at any batch, False
    # never. resolve() turns it off for the features it cannot keep exact yet (with a warning when
    # it was asked for).
    async_scheduling: bool | None = None
    # Resolved: the most running requests a step is planned ahead for (0: no limit).
    async_max_running: int = 0
    # vLLM's --num-scheduler-steps (its v0 multi-step scheduling): a decode step runs up to this many
    # forwards on the executor, each feeding the token just sampled, before its result returns
    # (actors/scheduler/multi_step.py). 1: one forward per step.
    num_scheduler_steps: int = 1
    # SGLang's and vLLM's --stream-interval: a request's streamed output goes out once this many
    # tokens wait (its first token and its end at once); multi-step decode sends the tokens of
    # every this many forwards while its step runs (actors/scheduler/request.py Request.delta).
    stream_interval: int = 1
    # vLLM v0's --multi-step-stream-outputs: False sends a multi-step step's tokens with its result only.
    multi_step_stream_outputs: bool = True

    def __attrs_post_init__(self) -> None:
        if self.enable_lora and (self.max_loras < 1 or self.max_lora_rank < 1 or self.max_cpu_loras < 0):
            raise ValueError("--max-loras and --max-lora-rank must be >= 1 (and --max-cpu-loras >= 0)")
        if self.max_queue_time_s < 0:
            raise ValueError(f"--max-queue-time-s must be >= 0, got {self.max_queue_time_s}")
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(f"--stream-interval must be in [1, {MAX_STREAM_INTERVAL}], got {self.stream_interval}")
        if self.collect_detailed_traces and not self.otlp_traces_endpoint:
            raise ValueError("--collect-detailed-traces needs --otlp-traces-endpoint")
        if self.speculative_config.enabled and self.tensor_parallel_size > 1:
            raise ValueError("--speculative-config with --tensor-parallel-size above 1 is not supported yet "
                             "(the ranks would have to share each step's drafts and accepted tokens)")
        _check_host_tier(self)
        _check_preemption(self)
        _check_multi_step(self)
        if not 0.0 <= self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.gpu_memory_utilization and not self.device.startswith("cuda"):
            raise ValueError("--gpu-memory-utilization sizes the KV cache on CUDA devices; on "
                             f"{self.device} give --kv-cache-memory (or vLLM's VLLM_CPU_KVCACHE_SPACE, in GiB)")
        if self.max_model_len < -1:
            raise ValueError(f"--max-model-len must be positive, -1 or auto, got {self.max_model_len}")
        if self.quantization not in SUPPORTED_QUANTIZATION:
            raise ValueError(f"--quantization {self.quantization}: not supported; Trillium implements "
                             "gguf (implied for .gguf files: Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K weights kept packed, "
                             "other types dequantized), awq and gptq (4-bit safetensors checkpoints, read from config.json)")
        if self.gguf_activations not in (None, "int8", "float32"):
            raise ValueError(f"--gguf-activations {self.gguf_activations!r}: choose int8 or float32")
        if self.compile_cpp_wrapper_max_batch < 0:
            raise ValueError(f"--compile-cpp-wrapper-max-batch must be >= 0, got {self.compile_cpp_wrapper_max_batch}")
        if self.compile_batch_sizes is not None and any(n < 1 for n in self.compile_batch_sizes):
            raise ValueError(f"--compile-batch-sizes must be positive, got {list(self.compile_batch_sizes)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r}: choose from {', '.join(KV_CACHE_DTYPES)}")
        from trillium.distributed.tp_checks import refuse_engine

        refuse_engine(self)

    @classmethod
    def build(cls, **args) -> "EngineConfig":
        """From flat engine arguments (CLI flags, `LLM(**kwargs)`): the kv tier
        ones (KV_TIER_ARGS, e.g. kv_host_bytes) go into `kv_tiers`."""
        tiers = {field: args.pop(flat) for flat, field in KV_TIER_ARGS.items() if flat in args}
        if tiers:
            args["kv_tiers"] = KvTierConfig(**tiers)
        if "speculative_config" in args:  # a dict, its JSON text, or None (vLLM's forms)
            args["speculative_config"] = parse_speculative_config(args["speculative_config"])
        return cls(**args)

    def to_bytes(self) -> bytes:
        return json.dumps(_converter.unstructure(self)).encode()

    @staticmethod
    def from_bytes(data: bytes) -> "EngineConfig":
        return _converter.structure(json.loads(data), EngineConfig)

    def resolve(self) -> "EngineConfig":
        """Fill max_model_len, num_blocks, dtype, kv_cache_dtype and served_model_name from the model."""
        from trillium.models.loader import load_model_config
        from trillium.models.llama import kv_cache_block_bytes

        from trillium.distributed.tp_checks import local_kv_model_config, refuse_model
        from trillium.models.checkpoint_files import find_gguf_file

        model_config = load_model_config(self.model)
        _check_quantization(self)
        refuse_model(self, model_config, find_gguf_file(self.model) is not None)
        dtype = self.dtype if self.dtype != "auto" else _auto_dtype(model_config, self.device)
        auto_len = self.max_model_len == -1  # vLLM's -1 / auto: the longest context the KV cache holds
        max_len = model_config.max_position_embeddings if auto_len or not self.max_model_len else self.max_model_len
        if max_len > model_config.max_position_embeddings:
            raise ValueError(
                f"--max-model-len {max_len} exceeds the model's context "
                f"({model_config.max_position_embeddings})"
            )
        if self.gpu_memory_utilization:
            from trillium.gpu_memory import kv_budget_from_utilization

            budget = kv_budget_from_utilization(self, model_config, dtype)
        else:
            budget = parse_memory(self.kv_cache_memory, _device_memory_bytes(self.device))
        kv_dtype = {"auto": dtype, "fp8": "fp8_e4m3"}.get(self.kv_cache_dtype, self.kv_cache_dtype)
        # Tensor parallel: the budget is per rank, a block there holds that rank's KV heads.
        per_block = kv_cache_block_bytes(local_kv_model_config(model_config, self.tensor_parallel_size),
                                         self.block_size, kv_dtype)
        # A proposer's own KV (eagle: the head's dense caches) is budgeted per target block.
        draft_per_block = draft_kv_block_bytes(self.speculative_config, model_config, self.block_size, dtype)
        num_blocks = self.num_blocks or budget // (per_block + draft_per_block)
        spec = self.speculative_config
        if spec.method == "draft_model":  # the draft's own KV cache (and weights) share the budget
            from trillium.speculative.draft_model import plan_draft_memory

            num_blocks, spec = plan_draft_memory(attrs.evolve(self, dtype=dtype, kv_cache_dtype=kv_dtype),
                                                 model_config, budget, per_block, bool(self.gpu_memory_utilization))
        if num_blocks < 2:
            raise ValueError(
                f"--kv-cache-memory {self.kv_cache_memory} holds {num_blocks} blocks "
                f"({per_block} bytes each); need at least 2"
            )
        window = uniform_sliding_window(model_config)
        if auto_len and not window:  # WHY not windowed: its blocks behind the window are freed
            max_len = min(max_len, int(num_blocks) * self.block_size)
        name = self.served_model_name or _default_served_name(self.model)
        runner, pooler, prefix_caching = _resolve_runner(self, model_config)
        if runner == "pooling" and self.speculative_config.enabled:
            raise ValueError("--speculative-config: pooling models do not generate; drop it")
        if runner == "pooling" and self.num_scheduler_steps > 1:
            raise ValueError("--num-scheduler-steps: pooling models do not generate; drop it")

        def fingerprint() -> str:
            from trillium.actors.kv_tiers.disk import model_fingerprint

            return model_fingerprint(self.model, dtype=dtype, kv_cache_dtype=kv_dtype, block_size=self.block_size)

        return attrs.evolve(
            self, dtype=dtype, kv_cache_dtype=kv_dtype, max_model_len=max_len, num_blocks=int(num_blocks),
            served_model_name=name, kv_tiers=self.kv_tiers.resolve(per_block, fingerprint), kv_block_bytes=per_block,
            vocab_size=model_config.vocab_size, runner=runner, pooler_config=pooler,
            enable_prefix_caching=prefix_caching, kv_sliding_window=window,
            enforce_eager=_resolve_enforce_eager(self.enforce_eager), speculative_config=spec,
            compile_batch_sizes=self.compile_batch_sizes if self.compile_batch_sizes is not None
            else default_compile_batch_sizes(self.max_num_seqs * (1 + spec.num_speculative_tokens)),
            compile_batch_sizes_defaulted=self.compile_batch_sizes is None or self.compile_batch_sizes_defaulted,
            async_scheduling=_resolve_async_scheduling(self, runner),
            async_max_running=ASYNC_AUTO_MAX_RUNNING if self.async_scheduling is None else 0,
        )

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    @property
    def num_kv_tokens(self) -> int:
        return self.num_blocks * self.block_size


def uniform_sliding_window(model_config) -> int:
    """The sliding window of every attention layer, when they all share one; else 0. Hybrid
    models (Gemma 2/3: some layers global) keep every block: one block table serves all layers."""
    windows = {model_config.layer_window(i) for i in range(model_config.num_layers)}
    if len(windows) != 1:
        return 0
    return windows.pop() or 0


# The test suite's one switch (tests/conftest.py): engines it starts, in process or as
# `trillium serve` children (they inherit the environment), run eager unless a test asks.
ENFORCE_EAGER_ENV = "TRILLIUM_ENFORCE_EAGER"


def _resolve_enforce_eager(value: bool | None) -> bool:
    if value is not None:
        return value
    return os.environ.get(ENFORCE_EAGER_ENV, "").strip().lower() in ("1", "true", "yes")


# Unset --async-scheduling plans ahead while at most this many requests run. WHY a limit: the step's
# hops (two ZeroMQ messages and the scheduler, ~1-2 ms) are a large share of a one-stream step and
# a small one of a batch's, while the planning and the detokenizing it moves beside the forward take
# CPU from the forward's threads on a small machine. Measured on the 2-core box, default model
# (README "Where a step's time goes"): async 1.11x at one stream, 0.98x at 16 and 64 streams.
ASYNC_AUTO_MAX_RUNNING = 4


def _resolve_async_scheduling(config: EngineConfig, runner: str) -> bool:
    """--async-scheduling (unset: on), off where it is not exact yet (then each step is planned after
    the last returned, as without it). WHY each: speculative decoding's drafts are counted from the
    previous step's result; the host / disk KV tiers move blocks whose reads and writes the in-flight
    step may still race; a pooling model ends every request after one step."""
    if config.async_scheduling is False:
        return False
    reasons = [why for why, on in (("--speculative-config", config.speculative_config.enabled),
                                   ("the host / disk KV tiers", config.kv_tiers.has_host),
                                   ("a pooling model", runner == "pooling")) if on]
    if reasons:
        if config.async_scheduling:  # asked for: say why it is off; unset: as vLLM, quietly
            log.warning("--async-scheduling is off: not supported yet with %s; steps are scheduled "
                        "synchronously", " and ".join(reasons))
        else:
            log.info("asynchronous scheduling off (not supported yet with %s)", " and ".join(reasons))
        return False
    return True


def _resolve_runner(config: EngineConfig, model_config) -> tuple[str, str, bool]:
    """(runner, pooler_config JSON, enable_prefix_caching). MEAN / CLS pooling need every prompt
    row computed, so prefix caching is off for them (actors/executor/pooler.py)."""
    from trillium.pooling.config import resolve_pooler

    runner, pooler = resolve_pooler(config.runner, config.convert, config.pooler_config, model_config)
    if pooler is None:
        return runner, "", config.enable_prefix_caching
    if config.enable_lora:
        raise ValueError("--enable-lora: LoRA adapters on pooling models are not supported yet")
    if pooler.pooling_type != "LAST" and config.enable_prefix_caching:
        import logging

        logging.getLogger(__name__).info("%s pooling: prefix caching is off (every prompt row is pooled)",
                                         pooler.pooling_type)
    keep = config.enable_prefix_caching and pooler.pooling_type == "LAST"
    if config.kv_tiers.has_host and not keep:
        raise ValueError(f"{pooler.pooling_type} pooling runs without prefix caching: drop --kv-host-bytes")
    return runner, pooler.to_json(), keep


def _check_host_tier(config: EngineConfig) -> None:
    config.kv_tiers.check(config.enable_prefix_caching)
    if config.sleep_keep_prefix_cache and not config.kv_tiers.has_host:
        raise ValueError("--sleep-keep-prefix-cache keeps the prefix cache in the host KV tier: "
                         "it needs --kv-host-bytes")


# The most forwards one multi-step decode step runs (bounds the executor's loop and the KV a step
# reserves ahead of what a request has produced).
MAX_SCHEDULER_STEPS = 16


def _check_multi_step(config: EngineConfig) -> None:
    steps = config.num_scheduler_steps
    if not 1 <= steps <= MAX_SCHEDULER_STEPS:
        raise ValueError(f"--num-scheduler-steps must be in 1..{MAX_SCHEDULER_STEPS}, got {steps}")
    if steps == 1:
        return
    if config.speculative_config.enabled:
        raise ValueError("--num-scheduler-steps above 1 with --speculative-config is not supported: both "
                         "emit several tokens per step through the same draft positions; pick one")
    if config.tensor_parallel_size > 1:
        raise ValueError("--num-scheduler-steps above 1 with --tensor-parallel-size above 1 is not supported "
                         "yet (the ranks would have to share each inner step's tokens)")


def _check_preemption(config: EngineConfig) -> None:
    from trillium.actors.scheduler.preemption import PREEMPTION_MODES

    if config.preemption_mode not in PREEMPTION_MODES:
        raise ValueError(f"--preemption-mode must be one of {list(PREEMPTION_MODES)}, got {config.preemption_mode!r}")
    if config.preemption_mode == "swap" and not config.kv_tiers.has_host:
        raise ValueError("--preemption-mode swap keeps preempted requests' KV in the host KV tier: "
                         "it needs --kv-host-bytes")


def kv_cache_memory_default(device: str, environ) -> str:
    """--kv-cache-memory when not given: vLLM's VLLM_CPU_KVCACHE_SPACE (GiB) on CPU, else the default."""
    space = environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if space and not device.startswith("cuda"):
        try:
            gib = float(space)
        except ValueError:
            raise ValueError(f"VLLM_CPU_KVCACHE_SPACE={space!r}: expected a number of GiB") from None
        if gib > 0:  # vLLM: 0 or unset means its default
            return f"{int(gib * 2**30)}B"
    return DEFAULT_KV_CACHE_MEMORY


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


def _check_quantization(config: EngineConfig) -> None:
    from trillium.models.checkpoint_files import find_gguf_file

    if config.quantization == "gguf" and find_gguf_file(config.model) is None:
        raise ValueError(f"--quantization gguf: {config.model} is not a .gguf file")
    if config.gguf_activations is not None and find_gguf_file(config.model) is None:
        raise ValueError(f"--gguf-activations {config.gguf_activations}: applies to .gguf models; "
                         f"{config.model} is not one")
    if config.gguf_activations is not None and config.gguf_dequantize:
        raise ValueError(f"--gguf-activations {config.gguf_activations} with --gguf-dequantize: no weight "
                         "stays packed, so there is no packed matmul to choose activations for")
    _check_int4_quantization(config)


def _check_int4_quantization(config: EngineConfig) -> None:
    """The checkpoint's AWQ/GPTQ quantization_config is one Trillium loads and agrees with --quantization
    (vLLM refuses a mismatch the same way: vllm/config ModelConfig._verify_quantization)."""
    from trillium.models.checkpoint_files import find_gguf_file
    from trillium.models.int4_checkpoint import quant_spec_of

    if find_gguf_file(config.model) is not None:
        if config.quantization in ("awq", "gptq"):
            raise ValueError(f"--quantization {config.quantization}: {config.model} is a .gguf file "
                             "(--quantization gguf, or leave it out)")
        return
    spec = quant_spec_of(config.model)  # ValueError naming an unsupported quant_method / bits / group
    if spec is not None and config.tensor_parallel_size > 1:
        raise ValueError(f"--tensor-parallel-size {config.tensor_parallel_size}: {spec.method.upper()} "
                         "checkpoints are not sharded; serve them with --tensor-parallel-size 1")
    if config.quantization in ("awq", "gptq") and (spec is None or spec.method != config.quantization):
        found = "no quantization_config (a float checkpoint)" if spec is None else f"quant_method {spec.method}"
        raise ValueError(f"--quantization {config.quantization}: {config.model} has {found} in config.json")
