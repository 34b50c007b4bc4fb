"""Compiled decode: the executor's forward for pure-decode steps, through torch.compile.

    build_forward(config, model) -> EagerForward | CompiledDecode
    forward(input_ids [T], positions [T], kv_caches, meta, lora) -> hidden [T, hidden]

The idea (vLLM's cudagraph capture sizes, on CPU): decode steps are small
and alike, so the model's forward for them is compiled once per batch-size
bucket (`--compile-batch-sizes`, default 1,2,4,8,16,32,64 up to the first
size that holds --max-num-seqs) at start, with Inductor's C++ backend. A step
whose requests all decode one token (T == B) and whose B fits a bucket is
padded to the next bucket and runs the compiled graph (so
does a speculative verify step whose T tokens fit one: its rows are decode
rows to the attention op);
everything else (prefill, mixed steps, larger batches, LoRA steps) runs
eager. Compile seconds per bucket are logged at start.

What is compiled: embedding, norms, projections (through opaque ops of ours:
float weights `trillium::cpu_linear`, `models/llama.py`; GGUF weights kept
packed `trillium::gguf_linear`, `models/packed_linear.py`), rope, MLP and
residuals. The norms, rope and SiLU are opaque ops too (`trillium::rms_norm`,
... in kernels/dispatch.py, C++ in native_ops.cpp), computing what eager does,
so every row a graph computes has the bits of the same row run eagerly, and a
request's greedy tokens do not depend on which of its steps ran in a graph
(batch size, speculation). Attention is an opaque op
reading the step's paged cache and metadata from a context
(`models/graph_attention.py`), so the graph does not depend on sequence
lengths or block tables and never recompiles between steps.

State the graph reads at each call (never baked in): the weights are graph
inputs (Dynamo lifts parameters; a weight update or a sleep that swaps
`param.data` is seen on the next step), the KV caches come from the context
(set per call: wake re-allocates them).

Per-step overhead: the small buckets' graphs (up to
--compile-cpp-wrapper-max-batch, default 4) are Inductor's C++ wrapper code (no
Python between ops), the others its Python wrapper; all call the C++ ops of
kernels/native_ops.py (the packed and float linears, the attention) where that
library builds, and each bucket's Dynamo bytecode is called directly, without
evaluating its guards
(direct_dispatch.py; a structural change of the model switches that off).

Native decode: with the C++ ops loaded, a pure-decode step of the plain Llama family (float32 or
packed GGUF weights, up to the rows its kernels take, whether or not a bucket holds it) skips the graph:
one C++ call runs the same kernels in the same order (models/native_decode.py); the graphs run what
it does not take (verify steps, fp8 KV caches, other families), eager what it ran before (LoRA steps).
TRILLIUM_NATIVE_DECODE=0 turns it off. With the default sizes, an engine whose native decode runs
every decode step it can make (_native_takes_every_decode_step) compiles no graph at all.

Cache on disk: Inductor's FX-graph and AOTAutograd caches live under
`trillium.local_cache.cache_dir()/inductor` (unless TORCHINDUCTOR_CACHE_DIR
is set), so a restart with the same model shapes and torch skips codegen and
the C++ compile.

`--enforce-eager` (or TRILLIUM_ENFORCE_EAGER=1, what the test suite sets)
gives `EagerForward`.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from trillium.actors.executor.direct_dispatch import DirectDispatch
from trillium.config import EngineConfig
from trillium.kernels import AttentionMetadata, native_ops, padded_rows
from trillium.kernels.metadata import DecodeRun
from trillium.kernels.paged_attention_cpu import MAX_VERIFY_ROWS
from trillium.models.graph_attention import GraphAttentionContext, graph_kv_slots
from trillium.models.native_decode import NativeDecode

log = logging.getLogger(__name__)


class EagerForward:
    """The model's own forward, every step."""

    compiled_sizes: tuple[int, ...] = ()

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, input_ids, positions, kv_caches, meta: AttentionMetadata, lora=None) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, lora=lora)

    # the most rows a native greedy run takes (CompiledDecode's; 0: none)
    greedy_rows: int = 0

    def greedy_run(self, first_ids: list[int], run: DecodeRun, kv_caches, stop_ids: list) -> np.ndarray | None:
        """Eager runs every forward itself (CompiledDecode's native greedy run): never taken."""
        return None


def build_forward(config: EngineConfig, model: torch.nn.Module) -> EagerForward:
    """The executor's forward for this config: compiled decode unless eager is asked or it cannot apply."""
    if config.enforce_eager:
        return EagerForward(model)
    reason = _unsupported(config, model)
    if reason:
        log.info("compiled decode off (%s): running eager", reason)
        return EagerForward(model)
    sizes = config.compile_batch_sizes
    if config.compile_batch_sizes_defaulted and _native_takes_every_decode_step(config, model):
        log.info("native decode takes every decode step of up to --max-num-seqs %d rows: no decode graph "
                 "compiled (--compile-batch-sizes compiles them)", config.max_num_seqs)
        sizes = ()
    tries = [config.compile_cpp_wrapper_max_batch, 0] if config.compile_cpp_wrapper_max_batch else [0]
    for cpp_max in tries:
        try:
            forward = CompiledDecode(model, sizes, cpp_wrapper_max_batch=cpp_max)
            forward.warm_up()
            return forward
        except Exception as exc:  # no C++ compiler, an Inductor failure: the Python wrapper, then eager, loudly
            then = "trying Inductor's Python wrapper only" if cpp_max else "running eager (--enforce-eager skips the try)"
            log.warning("compiled decode failed at start (C++ wrapper up to batch %d; %s: %s); %s",
                        cpp_max, type(exc).__name__, exc, then)
    return EagerForward(model)


def _native_takes_every_decode_step(config: EngineConfig, model: torch.nn.Module) -> bool:
    """Would native decode run every decode step this engine makes, so that no graph would ever run?
    The plain Llama family (NativeDecode.build), no more sequences than its kernels take, a float32 KV
    cache (an fp8 one runs the graphs' Python attention), no speculation (verify steps run graphs)."""
    if config.speculative_config.enabled or config.kv_cache_dtype != "float32":
        return False
    if not _load_native():
        return False
    native, _ = NativeDecode.build(model)
    return native is not None and config.max_num_seqs <= native.max_rows


def _unsupported(config: EngineConfig, model: torch.nn.Module) -> str:
    """Why this model/config runs eager even without --enforce-eager ('' when it compiles)."""
    if torch.device(config.device).type != "cpu":
        return f"{config.device}: compiled decode is CPU-only so far"
    if config.tensor_parallel_size > 1:
        return "tensor parallel ranks (their collectives stay outside graphs)"
    from trillium.models.int4_linear import Int4Linear

    int4 = next((m.format_name for m in model.modules() if isinstance(m, Int4Linear)), None)
    if int4 is not None:  # its own kernel, not (yet) behind an op of ours; GgufLinear's is (packed_linear.py)
        return f"{int4} weights kept packed"
    if not config.compile_batch_sizes:
        return "no --compile-batch-sizes"
    if config.runner == "pooling":
        return "a pooling model never decodes"
    family = model.config
    if family.moe is not None or family.gemma is not None:
        return f"{family.architecture}: compiled decode covers the dense Llama family (not MoE / Gemma yet)"
    return ""


def _load_native() -> bool:
    """Build / load the C++ ops the graphs call (kernels/native_ops.py), logging the seconds or why not
    (once: build_forward's decision and CompiledDecode both ask)."""
    if native_ops.loaded():
        return True
    start = time.perf_counter()
    if native_ops.load():
        log.info("native compiled-decode ops loaded in %.1f s (the graphs call the C kernels from C++)",
                 time.perf_counter() - start)
        return True
    log.info("native compiled-decode ops unavailable (%s): the graphs call the Python ops",
             native_ops.unavailable_reason() or "TRILLIUM_KERNELS=reference")
    return False


def _point_inductor_cache() -> str:
    """Inductor's on-disk caches under Trillium's cache dir (a user's TORCHINDUCTOR_CACHE_DIR wins)."""
    from trillium.local_cache import cache_dir

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # WHY the environment: Inductor reads its cache dir from TORCHINDUCTOR_CACHE_DIR only, and
    # writes its default (/tmp/torchinductor_$USER) there when importing its config
    # (torch/_inductor/runtime/cache_dir_utils.py); set before the first compile, in this process.
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def _no_graph() -> None:
    """CompiledDecode's structure watcher's function: it never captures a graph."""


class CompiledDecode(EagerForward):
    """Pure-decode steps of at most max(sizes) sequences through a graph compiled per bucket."""

    def __init__(self, model: torch.nn.Module, sizes: tuple[int, ...], cpp_wrapper_max_batch: int = 4) -> None:
        """Buckets up to `cpp_wrapper_max_batch` compile with Inductor's C++ wrapper, the rest with its
        Python wrapper (0: Python everywhere; bench/graph_wrapper.py compares the two)."""
        super().__init__(model)
        self.compiled_sizes = tuple(sorted(set(sizes)))
        self.cache_path = ""
        if self.compiled_sizes:  # none (native decode runs every step): no Inductor / Dynamo to import
            import torch._dynamo.config
            import torch._inductor.config

            self.cache_path = _point_inductor_cache()
            # WHY one thread in Inductor's kernels: at decode sizes (<= 64 rows) its pointwise
            # loops are microseconds, and an OpenMP barrier per kernel costs more than it saves
            # on a small shared CPU. The matmuls (oneDNN op) keep the executor's threads.
            torch._inductor.config.cpp.threads = 1
            # WHY no compile workers: the graph has a few dozen small kernels; a pool of worker
            # processes (each importing torch) costs more CPU than compiling them in this one.
            torch._inductor.config.compile_threads = 1
            # One graph per bucket on the same code object: let all of them live.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                       len(self.compiled_sizes) + 1)  # fmt: skip
        # Watches the model's structure for native decode too when no graph is compiled (a module or
        # parameter registered turns it off for good, as it does the graphs' direct path).
        self._structure = DirectDispatch(_no_graph, model)
        self.context = GraphAttentionContext()
        self.native_decode = None  # pure-decode steps in one C++ call (models/native_decode.py)
        if _load_native():
            self.context.native_step = native_ops.Step()
            self.native_decode, why_not = NativeDecode.build(model)
            log.info("native decode: %s", "on (decode steps of up to %d rows run one C++ call, no graph)"
                     % self.native_decode.max_rows if self.native_decode else f"off ({why_not})")
        slots = graph_kv_slots(self.context, len(model.model.layers))
        # WHY Inductor's C++ wrapper for the small buckets: the graph is a chain of opaque ops (~75 at
        # batch 1 for the bench model, ~270 for SmolLM2); the Python wrapper calls each through
        # torch.ops and checks each output's strides in Python, ~0.4 ms a step for the bench model
        # (bench/graph_wrapper.py on the 2-core AMD EPYC: 6.15 -> 5.79 ms, 1.06-1.10x). WHY not every
        # bucket: its C++ is slow to build (cold, 2 cores: the bench model's buckets 1-8 43 s against
        # 27; SmolLM2's 70-90 s a bucket against ~15, all 7 buckets 326 s at the default 4, 111 s at
        # 0), and a large bucket's step is long enough that the 0.4 ms is 1-4% of it. A cached start
        # is as fast either way.
        self.cpp_wrapper_sizes = tuple(n for n in self.compiled_sizes if n <= cpp_wrapper_max_batch)
        self._graphs: dict[int, tuple] = {}  # bucket -> (compiled function, its DirectDispatch)
        for cpp in (True, False):
            buckets = [n for n in self.compiled_sizes if (n in self.cpp_wrapper_sizes) == cpp]
            if buckets:
                compiled = self._compile(model, slots, cpp)
                self._graphs.update((n, compiled) for n in buckets)
        device = model.device
        # Padded inputs, one pair per bucket, reused every step.
        self._ids = {n: torch.zeros(n, dtype=torch.int64, device=device) for n in self.compiled_sizes}
        self._positions = {n: torch.zeros(n, dtype=torch.int64, device=device) for n in self.compiled_sizes}
        self.compile_s: dict[int, float] = {}
        self.num_compiled_steps = 0
        self.num_compiled_verify_steps = 0  # of which speculative verify steps (several rows a sequence)
        self.num_direct_steps = 0  # of which run without Dynamo's guard evaluation (direct_dispatch.py)
        self.num_native_steps = 0  # of which run natively, without the graph (models/native_decode.py)
        self.num_greedy_steps = 0  # of which in a native greedy run, LM head and argmax too (greedy_run)

    @staticmethod
    def _compile(model: torch.nn.Module, slots, cpp_wrapper: bool) -> tuple:
        def decode_graph(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids, positions, slots, None)

        # WHY a copy of the code object: Dynamo keeps its compiled entries (and its recompile
        # count) per code object, so a second engine in this process (tests, benchmarks), or the
        # other wrapper's buckets, would otherwise share, and exhaust, the first one's.
        decode_graph.__code__ = decode_graph.__code__.replace()
        graph = torch.compile(decode_graph, dynamic=False, options={"cpp_wrapper": cpp_wrapper})
        # Each bucket's Dynamo bytecode, called without guard evaluation (direct_dispatch.py).
        return graph, DirectDispatch(decode_graph, model)

    @property
    def direct_invalidated(self) -> str | None:
        """Why the guard-free path is off (a structural change of the model), None while it is on."""
        watchers = (self._structure, *(d for _, d in self._graphs.values()))
        return next((d.invalidated for d in watchers if d.invalidated), None)

    @property
    def native(self) -> bool:
        """Do the graphs call the C++ ops (kernels/native_ops.py)?"""
        return self.context.native_step is not None

    @torch.inference_mode()
    def warm_up(self) -> dict[int, float]:
        """Compile every bucket now (a cache hit is fast), logging seconds per bucket."""
        if not self.compiled_sizes:
            return self.compile_s
        log.info("compiling decode for batch sizes %s (a first start takes minutes on a small CPU, later "
                 "ones read %s; --enforce-eager skips it)", ",".join(map(str, self.compiled_sizes)),
                 self.cache_path)  # fmt: skip
        for size in self.compiled_sizes:
            start = time.perf_counter()
            self.context.meta = None  # warm-up: the attention op touches no cache
            graph, direct = self._graphs[size]
            with direct.capture(size):
                graph(self._ids[size], self._positions[size])
            self.compile_s[size] = time.perf_counter() - start
        log.info("compiled decode for batch sizes %s in %.1f s (%s; C++ wrapper for %s; cache %s)",
                 ",".join(map(str, self.compiled_sizes)), sum(self.compile_s.values()),
                 ", ".join(f"{n}: {s:.1f} s" for n, s in self.compile_s.items()),
                 ",".join(map(str, self.cpp_wrapper_sizes)) or "none", self.cache_path)  # fmt: skip
        return self.compile_s

    def bucket(self, meta: AttentionMetadata, lora) -> int:
        """The bucket this step runs in, 0 for eager. A speculative verify step (each sequence's
        last token and its drafts, `meta.verify_rows`) is bucketed by its tokens: the graph is
        per token row but for attention, which reads the step's metadata (graph_attention)."""
        num_tokens = meta.num_tokens
        if meta.max_query_len != 1 and not (meta.verify_rows and meta.max_query_len <= MAX_VERIFY_ROWS):
            return 0
        if not self.compiled_sizes or num_tokens > self.compiled_sizes[-1]:
            return 0
        if lora is not None and lora.has_work:
            return 0  # NOTE: LoRA deltas run eager (their per-slot batching is host-side Python)
        return next(n for n in self.compiled_sizes if n >= num_tokens)

    def __call__(self, input_ids, positions, kv_caches, meta: AttentionMetadata, lora=None) -> torch.Tensor:
        # Native decode first, at any row count it takes (no bucket needed: no graph runs)
        if self.native_decode is not None and meta.max_query_len == 1 and (lora is None or not lora.has_work):
            hidden = self._native(input_ids, positions, kv_caches, meta)
            if hidden is not None:
                return hidden
        size = self.bucket(meta, lora)
        if not size:
            return self.model(input_ids, positions, kv_caches, meta, lora=lora)
        num_tokens = input_ids.shape[0]
        ids, pos = self._ids[size], self._positions[size]
        ids[:num_tokens] = input_ids
        pos[:num_tokens] = positions
        if num_tokens < size:  # padding rows: token 0 at position 0 (the attention op skips them)
            ids[num_tokens:] = 0
            pos[num_tokens:] = 0
        self.context.kv_caches, self.context.meta = kv_caches, meta
        native_step = self.context.native_step
        try:
            if native_step is not None:
                native_step.set(kv_caches, meta)  # False: this step's attention runs the Python op
            # the bytecode was captured under inference mode (warm_up); grad mode goes through the guards
            guarded, direct = self._graphs[size]
            graph = None if torch.is_grad_enabled() else direct.get(size)
            self.num_direct_steps += graph is not None
            graph = graph or guarded
            with padded_rows.live_rows(num_tokens):  # the packed kernels skip the padding rows
                hidden = graph(ids, pos)
        finally:
            self.context.meta = None
            if native_step is not None:
                native_step.clear()
        self.num_compiled_steps += 1
        self.num_compiled_verify_steps += meta.max_query_len > 1
        return hidden[:num_tokens]

    @property
    def greedy_rows(self) -> int:
        """The most rows `greedy_run` takes (0: none: no native decode, or its LM head refused)."""
        native = self.native_decode
        return 0 if native is None or self.direct_invalidated is not None else native.greedy_rows

    def greedy_run(self, first_ids: list[int], run: DecodeRun, kv_caches, stop_ids: list) -> np.ndarray | None:
        """Decode forwards of `run` whose every row takes the argmax of its logits, through native
        decode's greedy run (NativeDecode.greedy): the tokens [m, rows], or None (not taken, nothing
        written: the caller runs its forwards one by one). Off with native decode."""
        native = self.native_decode
        if native is None or self.direct_invalidated is not None or torch.is_grad_enabled():
            return None
        step = self.context.native_step
        if not step.set_decode_run(kv_caches, run):
            return None
        try:
            tokens = native.greedy(first_ids, run, step, stop_ids)
        finally:
            step.clear()
        if tokens is not None:
            self.num_compiled_steps += len(tokens)
            self.num_native_steps += len(tokens)
            self.num_greedy_steps += len(tokens)
        return tokens

    def _native(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor | None:
        """A decode step through native decode, or None (not taken: the graph runs it). Off for good
        once the model's structure changed (direct_dispatch.py notices; the graphs' guards then decide)."""
        step = self.context.native_step
        if (input_ids.shape[0] > self.native_decode.max_rows or self.direct_invalidated is not None
                or torch.is_grad_enabled() or not step.set(kv_caches, meta)):
            return None
        try:
            hidden = self.native_decode(input_ids, positions, step)
        finally:
            step.clear()
        if hidden is not None:
            self.num_compiled_steps += 1
            self.num_native_steps += 1
        return hidden
