"""Native decode: a pure-decode forward of the dense Llama family in one C++ call (native_ops.cpp).

    NativeDecode.build(model) -> (NativeDecode | None, reason)   None: this model runs the graphs
    native(input_ids [n], positions [n], step) -> hidden [n, hidden] | None
        step: the compiled runner's native_ops.Step, set for this forward's metadata (a decode step,
        every row one token); None: refused before anything was written (the caller runs the graph)

WHY: a float32 decode forward of the bench model (8 layers) spends ~0.7 ms of a ~6 ms token on glue
around its kernels (compiled decode's C++ wrapper calls ~75 ops through torch's dispatcher, each
allocating its output; then the Dynamo/AOT Python around the graph call): on a tiny 8-layer model,
where the kernels cost nearly nothing, a forward took 0.75-0.89 ms. Here the same C kernels run in the
same order with the same arguments (so each row has the graph's bits, and eager's), from one C++ loop
over the layers with its buffers kept between calls.

What it takes (else build() says why, and compiled decode runs the graphs as before): exactly the
plain Llama modules (`LlamaForCausalLM` with `DecoderLayer`, `Attention` without softcapping, its
q/k norms RMSNorm if any, `MLP` with SiLU, `RMSNorm`; Llama, Mistral, Qwen2, Qwen3), float32 on the
CPU, one tensor-parallel rank, the C kernels built. Per forward: a decode step (one token a row) on
float32 caches the native step takes, of no more rows than every linear's kernel takes: float32 ones
dense_cpu.MAX_ROWS, or up to MAX_ROWS where panel_cpu runs float32 linears past those rows (a Zen
4-class CPU; then on the weights' panel-packed copies, as the graphs' `trillium::cpu_linear` runs
them); packed GGUF ones their kernel's 32 / 64. LoRA steps, speculative verify steps and anything
larger run the graphs (or eager).

WHY past dense_cpu's rows too: at 40 rows (the all-at-once workload's decode) a graph step left the
second core spinning at OpenMP's barriers ~22% of its time (perf) while the first ran the graph's
Python, torch's output allocations and zero fills, and the sampler between forwards; natively the
kernels are ~86% of both cores' time (72% through the graphs) and 64 requests at once ran ~1.06x.

The weights are read at each call through the module's Parameter objects (a `param.data` swap or an
in-place update is seen); a structural change of the model (a module or parameter registered) turns
compiled decode's direct path off (direct_dispatch.py), and this with it.

TRILLIUM_NATIVE_DECODE=0 turns it off (A/B: bench/compiled_decode.py's graphs column, or two servers).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from trillium import kernels
from trillium.kernels import dense_cpu, gguf_cpu, native_ops, onednn_packed, panel_cpu
from trillium.kernels.metadata import DecodeRun
from trillium.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, Linear, RMSNorm
from trillium.models.packed_linear import GgufLinear, packed_rows

_INT8 = 1 << 16  # native_ops.cpp's kNativeLinearInt8
MAX_ROWS = 256  # native_ops.cpp's kNativeRows: the most rows a native forward takes


class NativeDecode:
    def __init__(self, model: LlamaForCausalLM) -> None:
        config = model.local_config
        layers = list(model.model.layers)
        self.model = model
        self._lib = native_ops.library()
        self._shape = (len(layers), config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                       config.intermediate_size)
        self._eps = ctypes.c_float(model.model.norm.eps)
        self._scale = ctypes.c_float(layers[0].self_attn.scale)
        self._windows = (ctypes.c_long * len(layers))(*(layer.self_attn.sliding_window or 0 for layer in layers))
        # The weight tensors (Parameters, a packed linear's blocks buffer) in native_ops.cpp's order:
        # their storage is read at each call.
        self._params: list[torch.Tensor | None] = []
        linears: list[torch.nn.Module] = []  # qkv, o, gate/up, down of each layer
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            own = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            (qkv, qkv_b), (o, o_b), (gu, gu_b), (down, down_b) = (_weight_of(m) for m in own)
            q_norm, k_norm = (None if m is None else m.weight for m in (attn.q_norm, attn.k_norm))
            self._params += [layer.input_layernorm.weight, qkv, qkv_b, o, o_b, layer.post_attention_layernorm.weight,
                             gu, gu_b, down, down_b, q_norm, k_norm]
            linears += own
        self._kinds = (ctypes.c_long * len(linears))(*(_kind_of(m) for m in linears))
        # float32 linears of more than dense_cpu.MAX_ROWS rows run on their panel-packed copies, as the
        # graphs' trillium::cpu_linear does (models/llama.py `_cpu_linear_rows`): (index, module)
        self._float_linears = [(i, m) for i, m in enumerate(linears) if not isinstance(m, GgufLinear)]
        self._panel_ptrs = (ctypes.c_void_p * len(linears))()  # their copies' data (read past dense_cpu's rows)
        # What each must stay (the C++ loop takes the sizes from the config: a swap to another shape
        # would read past a tensor; the graph's ops would raise, so the graph runs it instead)
        self._layouts = [None if p is None else (p.dtype, p.shape) for p in self._params]
        # the rows every linear's kernel takes (native_ops.cpp): float32 ones dense_cpu's, or any up to
        # MAX_ROWS where panel_cpu runs those past dense_cpu's; packed ones their kernel's per mode
        float_rows = MAX_ROWS if panel_cpu.active() else dense_cpu.MAX_ROWS
        self.max_rows = min([MAX_ROWS, *(packed_rows(m.activations) if isinstance(m, GgufLinear) else float_rows
                                         for m in linears)])
        self._embed = model.model.embed_tokens.weight
        self._final_norm = model.model.norm.weight
        self._params += [self._embed, self._final_norm]  # after the layers' pointers: passed on their own
        self._layouts += [(p.dtype, p.shape) for p in (self._embed, self._final_norm)]
        # The LM head, for the greedy run (its rows are the vocabulary the argmax picks from)
        head = model.lm_head
        self._head_kind = -1 if head is None else _kind_of(head)
        self._head, self._head_bias = (model.lm_head_weight, None) if head is None else _weight_of(head)
        self.greedy_refused = _unsupported_head(model)  # '' when greedy() runs
        # the most rows greedy() takes (0: none): the layers' and the head's kernels'
        self.greedy_rows = 0 if self.greedy_refused else min(
            self.max_rows, packed_rows(head.activations) if isinstance(head, GgufLinear) else float_rows)
        self._head_panel: int | None = None  # the head's panel-packed copy (greedy runs past dense_cpu's rows)
        self._head_layouts = [None if p is None else (p.dtype, p.shape) for p in (self._head, self._head_bias)]
        self._weights = [p for p in self._params if p is not None]
        self._addresses: list[int] = []  # self._weights' data_ptr()s when self._pointers was filled
        self._num_layer_pointers = len(layers) * 12  # native_ops.cpp's kNativeLayerPointers a layer
        self._pointers = (ctypes.c_void_p * self._num_layer_pointers)()  # the layers' (native_ops.cpp's order)
        self.num_calls = 0

    @staticmethod
    def build(model: torch.nn.Module) -> tuple["NativeDecode | None", str]:
        """This model's native decode, or None and why not."""
        if os.environ.get("TRILLIUM_NATIVE_DECODE", "1") == "0":
            return None, "TRILLIUM_NATIVE_DECODE=0"
        if not native_ops.loaded():
            return None, "the native ops did not load"
        reason = _unsupported(model)
        if reason:
            return None, reason
        return NativeDecode(model), ""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, step: native_ops.Step) -> torch.Tensor | None:
        n = input_ids.shape[0]
        if (not 0 < n <= self.max_rows or input_ids.dtype != torch.int64 or positions.dtype != torch.int64
                or not input_ids.is_contiguous() or not positions.is_contiguous() or positions.shape[0] != n):
            return None
        if not self._refresh():
            return None
        if not self._panels(n):
            return None
        out = torch.empty(n, self._shape[1], dtype=torch.float32)
        rc = self._lib.trillium_native_decode(step.handle, n, input_ids.data_ptr(), positions.data_ptr(),
                                              *self._model_args(), out.data_ptr(), torch.get_num_threads())
        if rc == -1:
            return None
        if rc != 0:
            raise RuntimeError(f"native decode: a kernel refused a step of {n} rows midway (rc {rc})")
        self.num_calls += 1
        return out

    def greedy(self, first_ids: list[int], run: DecodeRun, step: native_ops.Step,
               stop_ids: list[frozenset[int]], logits: torch.Tensor | None = None) -> np.ndarray | None:
        """Up to run.num_steps decode forwards of run.num_seqs rows (native_ops.cpp trillium_native_greedy),
        each row's next input the argmax of the LM head's logits, the first fed `first_ids`: the
        tokens [m, rows], m <= num_steps (the run ends after a forward in which a row sampled one of its
        `stop_ids`); None, nothing written, where it does not take them. `step`: set to `run`
        (Step.set_decode_run). `logits` [num_steps, rows, vocab] float32 receives the logits (tests)."""
        n, num_steps = run.num_seqs, run.num_steps
        if not 0 < n <= self.greedy_rows or len(first_ids) != n or len(stop_ids) != n:
            return None
        if any(p is not None and ((p.dtype, p.shape) != layout or not p.is_contiguous())
               for p, layout in zip((self._head, self._head_bias), self._head_layouts)):
            return None  # the head swapped for another shape: the sampler path's ops check it
        if logits is not None and (logits.dtype != torch.float32 or not logits.is_contiguous()
                                   or logits.shape != (num_steps, n, self._head.shape[0])):
            raise ValueError(f"logits must be contiguous float32 [{num_steps}, {n}, {self._head.shape[0]}]")
        if not self._refresh():
            return None
        if not self._panels(n, head=True):
            return None
        ids = np.asarray(first_ids, dtype=np.int64)
        stops = [sorted(s) for s in stop_ids]
        flat = np.fromiter((t for s in stops for t in s), dtype=np.int64, count=sum(map(len, stops)))
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(s) for s in stops], out=offsets[1:])
        tokens = np.empty((num_steps, n), dtype=np.int64)
        bias = self._head_bias
        rc = self._lib.trillium_native_greedy(
            step.handle, n, num_steps, ids.ctypes.data, run.slots.data_ptr(), run.lens.data_ptr(), flat.ctypes.data,
            offsets.ctypes.data, self._head.data_ptr(), self._head_panel, None if bias is None else bias.data_ptr(),
            self._head_kind, self._head.shape[0], *self._model_args(), tokens.ctypes.data,
            None if logits is None else logits.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc == -1:
            return None
        if rc < 0:
            raise RuntimeError(f"native decode: a kernel refused a greedy run of {n} rows midway (rc {rc})")
        self.num_calls += rc
        return tokens[:rc]

    def _refresh(self) -> bool:
        """The layers' pointers for this call; False (the graph runs it) when a tensor no longer has
        the dtype, shape or contiguity the C++ loop reads it with."""
        addresses = [p.data_ptr() for p in self._weights]  # WHY each call: a `param.data` swap moves them
        if addresses != self._addresses:
            if any(p is not None and ((p.dtype, p.shape) != layout or not p.is_contiguous())
                   for p, layout in zip(self._params, self._layouts)):
                return False  # something else swapped in: the graph (and its ops' checks) runs it
            self._pointers[:] = [None if p is None else p.data_ptr() for p in self._params[:self._num_layer_pointers]]
            self._addresses = addresses
        return True

    def _panels(self, n: int, head: bool = False) -> bool:
        """Past dense_cpu.MAX_ROWS rows, point the panel pointers (and with `head` the LM head's) at
        each float32 weight's panel-packed copy, made or checked as the graphs' linear makes or checks
        it (onednn_packed.copy_of: packed again after a weight changed); up to that many rows the C++
        loop reads none. False -- the graph runs it -- where panel_cpu would not take a weight."""
        if n <= dense_cpu.MAX_ROWS:
            return True
        weights = [(index, module.weight) for index, module in self._float_linears]
        if head and self._head_kind < 0:
            weights.append((-1, self._head))
        if not all(isinstance(weight, torch.nn.Parameter) for _, weight in weights):
            return False  # _cpu_linear_rows would run oneDNN: not these bits
        for index, weight in weights:
            address = onednn_packed.copy_of(weight, "panel", panel_cpu.pack).data_ptr()
            if index < 0:
                self._head_panel = address
            else:
                self._panel_ptrs[index] = address
        return True

    def _model_args(self) -> tuple:
        """trillium_native_decode's arguments from num_layers to table_rows."""
        table = self.model.cos_sin_cache
        return (*self._shape, self._eps, self._scale, self._windows, self._pointers, self._kinds, self._panel_ptrs,
                self._embed.data_ptr(), self._embed.shape[0], self._final_norm.data_ptr(), table.data_ptr(),
                table.shape[0])


def _unsupported(model: torch.nn.Module) -> str:
    """Why this model's decode cannot run natively ('' when it can)."""
    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} is not the plain Llama family"
    if model.tp.size != 1:
        return "tensor parallel"
    if not dense_cpu.available():
        return "no dense_cpu kernel"
    config = model.local_config
    table = model.cos_sin_cache
    if table.dtype != torch.float32 or not table.is_contiguous() or table.shape[1] != config.head_dim:
        return "a rope table other than float32 [positions, head_dim]"
    if type(model.model.norm) is not RMSNorm or model.model.embed_tokens.weight.dtype != torch.float32:
        return "not float32 with RMSNorm"
    eps, scale = model.model.norm.eps, None
    for index, layer in enumerate(model.model.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (type(layer) is not DecoderLayer or type(attn) is not Attention or type(mlp) is not MLP
                or type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm):
            return f"layer {index} is not the plain Llama layer"
        if attn.softcap is not None:
            return "attention softcapping"
        if attn.q_norm is not None and (type(attn.q_norm) is not RMSNorm or type(attn.k_norm) is not RMSNorm
                                        or {attn.q_norm.eps, attn.k_norm.eps} != {eps}):
            return "q/k norms other than RMSNorm of the model's eps"
        if mlp.act_and_mul is not kernels.silu_and_mul:
            return "an MLP activation other than SiLU"
        if {layer.input_layernorm.eps, layer.post_attention_layernorm.eps} != {eps}:
            return "norms with different eps"
        scale = attn.scale if scale is None else scale
        if attn.scale != scale:
            return "layers with different attention scales"
        for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if type(m) is Linear and m.weight.dtype == torch.float32:
                continue
            if type(m) is GgufLinear and m.group is None and m.blocks.dtype == torch.uint8:
                if not gguf_cpu.available():
                    return "no packed GGUF kernel"
                continue
            return f"a {type(m).__name__} linear (float32 or packed GGUF weights only)"
        if any(m is not None and m.dtype != torch.float32 for m in (attn.qkv_proj.bias, attn.o_proj.bias,
                                                                     mlp.gate_up_proj.bias, mlp.down_proj.bias)):
            return "biases other than float32"
    return ""


def _unsupported_head(model: LlamaForCausalLM) -> str:
    """Why the greedy run cannot take this model's LM head ('' when it can): it runs the head as
    compute_logits does only for a float32 or packed GGUF linear of one logit row a token id."""
    head = model.lm_head
    if head is None:
        weight = model.lm_head_weight
        ok = weight.dtype == torch.float32 and weight.is_contiguous()
    elif type(head) is Linear:
        ok = head.weight.dtype == torch.float32 and (head.bias is None or head.bias.dtype == torch.float32)
    else:
        ok = type(head) is GgufLinear and head.group is None and head.blocks.dtype == torch.uint8
        ok = ok and gguf_cpu.available() and (head.bias is None or head.bias.dtype == torch.float32)
    if not ok:
        kind = type(head).__name__ if head is not None else "tied"
        return f"an LM head of {kind} weights other than float32 / packed GGUF"
    rows = (model.lm_head_weight if head is None else _weight_of(head)[0]).shape[0]
    if rows != model.model.embed_tokens.weight.shape[0]:
        return f"an LM head of {rows} rows beside an embedding of {model.model.embed_tokens.weight.shape[0]}"
    return ""


def _weight_of(linear: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear's weight as the kernel reads it (a packed one's blocks) and its bias."""
    return (linear.blocks if isinstance(linear, GgufLinear) else linear.weight), linear.bias


def _kind_of(linear: torch.nn.Module) -> int:
    """native_ops.cpp's linear kind: -1 float32, else the GGUF type (| int8 activations)."""
    if not isinstance(linear, GgufLinear):
        return -1
    return linear.ggml_type | (_INT8 if linear.activations == gguf_cpu.INT8 else 0)


__all__ = ["NativeDecode"]
