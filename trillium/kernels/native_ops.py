"""Compiled decode's hot ops in C++ (native_ops.cpp): the graph reaches the C kernels with no Python between.

    load() -> bool                       build (first use, ~15-30 s; cached on disk) and bind; False where it cannot
    unavailable_reason() -> str | None   why load() is False
    library() -> ctypes.CDLL             the bound library (trillium_native_decode: models/native_decode.py)
    set_live_rows(n | None)              this thread's live-row hint for the native linears (padded_rows.py)
    Step()                               the native attention's per-step state, one per compiled runner:
        .set(kv_caches, meta) -> bool    point it at this step's float32 caches and metadata (False: the
                                         op falls back to trillium::graph_attention this step)
        .clear()                         after the call: the pointers are dead from here on
        .id                              the int the graph passes the op (a small index, the same in every
                                         process for the same steps: Inductor's disk cache keys graphs by it)

    torch.ops.trillium_native.gguf_linear(x, blocks, ggml_type, in_features, bias, int8)
    torch.ops.trillium_native.cpu_linear(x, weight, bias)
    torch.ops.trillium_native.graph_attention(q, k, v, context, step, layer, scale, sliding_window, softcap)
    torch.ops.trillium_native.rms_norm(x, weight, eps)                     float32 (rowwise_cpu.c; else the twin)
    torch.ops.trillium_native.silu_and_mul(x)
    torch.ops.trillium_native.rotary_embedding(positions, q, k, table)

Each does what the Python op of the same name in the `trillium` namespace does (models/packed_linear.py,
models/llama.py, models/graph_attention.py) for the calls a compiled decode graph makes -- the packed
kernel's rows (up to 32 / 64), dense_cpu's rows (up to dense_cpu.MAX_ROWS: 64, or 16 on a non-Intel AVX-512 CPU such as a Zen 4), a float32 cache's decode or verify step -- and calls the same C kernels, so the bits are the same. The Python callers pick the native op only
for those shapes (a static decision at trace time), and the native attention calls the Python op
itself for a step `Step.set` does not take (fp8 caches, TRILLIUM_KERNELS=reference, ...).

The row-wise ops call rowwise_cpu.c, as eager does, so Inductor cannot fuse norms, rope and SiLU
into loops that round otherwise (dispatch.py says why that matters); where the library does not load
the graphs call their Python twins (`trillium::rms_norm`, ... in dispatch.py), opaque too.

WHY: ~150 op calls per SmolLM2 decode step. Through the dispatcher into Python, with each op's checks
and its ctypes call, those cost ~20-50 us each; into C++, ~3 us (bench/native_ops.py).

Build: the system C++ compiler (`c++`, `g++` or `clang++`) against the running torch's headers and
libraries (`torch/include`, `torch/lib`), keyed like every kernel (source, flags -- which name the torch
version --, compiler, CPU flags) under `local_cache.cache_dir()/kernels`. Where no C++ compiler is found
or the build fails, load() is False, the start-up log says why, and the graphs call the Python ops.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from trillium.kernels import dense_cpu, gguf_cpu, paged_attention_cpu, panel_cpu, rowwise_cpu
from trillium.kernels.c_library import CXX, CLibrary
from trillium.kernels.dispatch import ROW_WISE_FAKES

_SOURCE = Path(__file__).with_name("native_ops.cpp")
_TORCH = Path(torch.__file__).parent
_FLAGS = (
    "-O2", "-std=c++17", "-shared", "-fPIC", "-w",
    f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
    f"-DTRILLIUM_TORCH_VERSION=\"{torch.__version__}\"",  # a new torch builds anew (the cache key has the flags)
    f"-I{_TORCH / 'include'}", f"-I{_TORCH / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
    # WHY --no-as-needed: the libraries come before the source on the command line (c_library.py)
    f"-L{_TORCH / 'lib'}", f"-Wl,-rpath,{_TORCH / 'lib'}", "-Wl,--no-as-needed", "-lc10", "-ltorch_cpu",
)  # fmt: skip
_P, _L = ctypes.c_void_p, ctypes.c_long


def _declare(lib: ctypes.CDLL) -> None:
    lib.trillium_native_bind.argtypes = [_P, _P, _P, _P, _P, _P, _P, _P]
    lib.trillium_native_bind.restype = None
    lib.trillium_native_bind_panel.argtypes = [_P, _L]
    lib.trillium_native_bind_panel.restype = None
    lib.trillium_native_set_live_rows.argtypes = [_L]
    lib.trillium_native_set_live_rows.restype = None
    lib.trillium_native_step_new.argtypes = []
    lib.trillium_native_step_new.restype = _P
    lib.trillium_native_step_id.argtypes = [_P]
    lib.trillium_native_step_id.restype = _L
    lib.trillium_native_step_free.argtypes = [_P]
    lib.trillium_native_step_free.restype = None
    lib.trillium_native_step_caches.argtypes = [_P, _L, _P, _P, _L, _L, _L, _L]
    lib.trillium_native_step_caches.restype = None
    lib.trillium_native_step_set.argtypes = [_P, _L, _P, _P, _L, _P, _P]
    lib.trillium_native_step_set.restype = None
    lib.trillium_native_decode.argtypes = [_P, _L, _P, _P, _L, _L, _L, _L, _L, _L, ctypes.c_float, ctypes.c_float,
                                           _P, _P, _P, _P, _P, _L, _P, _P, _L, _P, ctypes.c_int]
    lib.trillium_native_decode.restype = ctypes.c_int
    lib.trillium_native_greedy.argtypes = [_P, _L, _L, _P, _P, _P, _P, _P, _P, _P, _P, _L, _L, _L, _L, _L, _L, _L,
                                           _L, ctypes.c_float, ctypes.c_float, _P, _P, _P, _P, _P, _L, _P, _P, _L, _P,
                                           _P, ctypes.c_int]
    lib.trillium_native_greedy.restype = ctypes.c_int


_LIBRARY = CLibrary(_SOURCE, "the native compiled-decode ops", _declare, compilers=CXX, flags=_FLAGS,
                    fallback="compiled decode calls the Python ops")
_BOUND: list[ctypes.CDLL] = []  # the library once bound to the C kernels


def unavailable_reason() -> str | None:
    if _BOUND:
        return None
    lib = _LIBRARY.get()
    if lib is None:
        return _LIBRARY.unavailable_reason()
    kernels = (gguf_cpu, dense_cpu, paged_attention_cpu, rowwise_cpu)
    missing = [m.__name__.rpartition(".")[2] for m in kernels if not m.available()]
    return f"C kernels unavailable: {', '.join(missing)}" if missing else None


def load() -> bool:
    """Build and load the library and hand it the C kernels' addresses (once); False where it cannot."""
    if _BOUND:
        return True
    if os.environ.get("TRILLIUM_KERNELS", "") == "reference" or unavailable_reason() is not None:
        return False
    lib = _LIBRARY.get()
    gguf, dense, attention, rowwise = (m._LIBRARY.get() for m in (gguf_cpu, dense_cpu, paged_attention_cpu, rowwise_cpu))
    address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
    lib.trillium_native_bind(address(gguf.trillium_gguf_row_bytes), address(gguf.trillium_gguf_matmul),
                             address(gguf.trillium_gguf_matmul_q8),
                             address(dense.trillium_f32_linear), address(attention.trillium_paged_decode_attention),
                             address(rowwise.trillium_rms_norm), address(rowwise.trillium_silu_and_mul),
                             address(rowwise.trillium_rope))
    # float32 linears past dense_cpu's rows: the panel kernel where models/llama.py runs them on it
    panel = panel_cpu._LIBRARY.get() if panel_cpu.active() else None
    lib.trillium_native_bind_panel(None if panel is None else address(panel.trillium_panel_linear), dense_cpu.MAX_ROWS)
    _BOUND.append(lib)
    return True


def loaded() -> bool:
    """Is the library bound (load() ran and succeeded)? Cheap: the graphs' callers ask at trace time."""
    return bool(_BOUND)


def library() -> ctypes.CDLL:
    """The bound library (after load()): models/native_decode.py calls trillium_native_decode on it."""
    return _BOUND[0]


def set_live_rows(n: int | None) -> None:
    if _BOUND:
        _BOUND[0].trillium_native_set_live_rows(-1 if n is None else n)


class Step:
    """The native attention's view of one step (see the module docstring); needs load()."""

    def __init__(self) -> None:
        self._lib = _BOUND[0]
        self.handle: int = self._lib.trillium_native_step_new() or 0  # 0: none free, the Python op runs
        self.id: int = self._lib.trillium_native_step_id(self.handle) if self.handle else 0
        self._caches_key: tuple = ()
        self._keep: tuple = ()  # this step's tensors the pointers read

    def __del__(self) -> None:
        lib, handle = getattr(self, "_lib", None), getattr(self, "handle", None)
        if lib is not None and handle:
            lib.trillium_native_step_free(handle)
            self.handle = 0

    def set(self, kv_caches: list, meta) -> bool:
        """Take this step natively when every cache is float32 (contiguous, one shape) and the kernel
        takes the step (`paged_attention_cpu.step_supported`, on layer 0's cache); else False, and the op
        runs the Python one."""
        if not self._takes(kv_caches, meta):
            return self._none()
        if meta.max_query_len == 1:
            row_seq, row_lens = None, meta.seq_lens
        else:
            row_seq, row_lens = paged_attention_cpu._verify_rows(meta)
        slots = meta.slot_mapping
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            return self._none()
        self._keep = (kv_caches, slots, meta.block_tables, row_lens, row_seq)
        self._lib.trillium_native_step_set(self.handle, meta.num_tokens, slots.data_ptr(),
                                           meta.block_tables.data_ptr(), meta.block_tables.stride(0),
                                           row_lens.data_ptr(), None if row_seq is None else row_seq.data_ptr())
        return True

    def set_decode_run(self, kv_caches: list, run) -> bool:
        """Point it at decode steps of a `kernels.metadata.DecodeRun` (trillium_native_greedy moves the
        slots and key counts along its steps); False where `set` would refuse its first step."""
        if not self._takes(kv_caches, run.first_step()):
            return self._none()
        self._keep = (kv_caches, run)
        self._lib.trillium_native_step_set(self.handle, run.num_seqs, run.slots.data_ptr(), run.tables.data_ptr(),
                                           run.tables.stride(0), run.lens.data_ptr(), None)
        return True

    def _takes(self, kv_caches: list, meta) -> bool:
        """A step there is, the kernel takes the step (`paged_attention_cpu.step_supported`, on layer
        0's cache) and every cache (`_set_caches`)."""
        return (bool(self.handle) and bool(kv_caches)
                and paged_attention_cpu.step_supported(kv_caches[0].k_cache, kv_caches[0].v_cache, meta)
                and self._set_caches(kv_caches))

    def _set_caches(self, kv_caches: list) -> bool:
        """The layers' float32 caches (contiguous, one shape), told to the C++ step when they moved."""
        shape = kv_caches[0].k_cache.shape
        pointers = tuple((c.k_cache.data_ptr(), c.v_cache.data_ptr()) for c in kv_caches)
        key = (shape, kv_caches[0].k_cache.dtype, pointers)  # a re-allocation may reuse the addresses
        if key != self._caches_key:
            if any(c.k_cache.dtype != torch.float32 or c.v_cache.dtype != torch.float32 or c.k_cache.shape != shape
                   or c.v_cache.shape != shape or not (c.k_cache.is_contiguous() and c.v_cache.is_contiguous())
                   for c in kv_caches):  # fmt: skip
                return False
            ks = (ctypes.c_void_p * len(kv_caches))(*(k for k, _ in pointers))
            vs = (ctypes.c_void_p * len(kv_caches))(*(v for _, v in pointers))
            self._lib.trillium_native_step_caches(self.handle, len(kv_caches), ks, vs, *shape)
            self._caches_key = key
        return True

    def clear(self) -> None:
        self._none()

    def _none(self) -> bool:
        if self.handle:
            self._lib.trillium_native_step_set(self.handle, -1, None, None, 0, None, None)
        self._keep = ()
        return False


# The schemas and fake implementations are here, so they exist (and Inductor can trace callers)
# whether or not the C++ library builds; native_ops.cpp registers the CPU kernels.
_LIB = torch.library.Library("trillium_native", "DEF")
# WHY a bool and not trillium::gguf_linear's str: Inductor's C++ wrapper calls an op whose arguments
# are tensors and numbers through torch's stable C ABI; a str sends it to the boxed path instead (a
# vector of IValues and a std::string built at every call, and the dispatcher's headers to compile).
_LIB.define("gguf_linear(Tensor x, Tensor blocks, int ggml_type, int in_features, Tensor? bias, bool int8) "
            "-> Tensor")
_LIB.define("cpu_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.define("graph_attention(Tensor q, Tensor k, Tensor v, int context, int step, int layer, float scale, "
            "int? sliding_window, float? softcap) -> Tensor")
_LIB.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_LIB.define("silu_and_mul(Tensor x) -> Tensor")
_LIB.define("rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor cos_sin_cache) -> (Tensor, Tensor)")


@torch.library.register_fake("trillium_native::gguf_linear")
def _(x, blocks, ggml_type, in_features, bias, int8):
    return x.new_empty((x.shape[0], blocks.shape[0]))


@torch.library.register_fake("trillium_native::cpu_linear")
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("trillium_native::graph_attention")
def _(q, k, v, context, step, layer, scale, sliding_window, softcap):
    return torch.empty_like(q)


for _name, _fake in ROW_WISE_FAKES.items():
    torch.library.register_fake(f"trillium_native::{_name}")(_fake)


__all__ = ["Step", "library", "load", "loaded", "set_live_rows", "unavailable_reason"]
