"""GGUF weights kept packed: the projections multiply llama.cpp's blocks directly.

    PackedTensor(blocks [rows, row_bytes] uint8, ggml_type, shape (rows, K))   one GGUF weight, still in blocks
    GgufLinear(blocks, ggml_type, in_features, bias)                           a `Linear` whose weight is blocks
    install_packed(model, {HF name: PackedTensor}) -> PackedReport             swap Linears for GgufLinears

The loader (`loader.py`) hands `install_packed` the packable GGUF weights
after every float weight is in. Each projection of the model (the fused
`qkv_proj` / `gate_up_proj`, `o_proj`, `down_proj`, the LM head) whose
sources are all one packable format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) becomes a `GgufLinear`
holding their blocks, rows stacked in the fused order (every GGUF format
quantizes along K only, so rows concatenate). Anything else -- mixed formats
in one fused projection, routers and experts (which read `.weight` directly)
-- is dequantized into the float parameters as before, and the report says so.

A tied LM head keeps the float embedding for the lookup (one row per token)
and gets a packed `lm_head` of the same blocks for the logits matmul, which
reads the whole matrix every step.

Forward: up to `DEQUANTIZE_ROWS` activation rows (decode, small batches; 64 with int8 activations) run
the packed kernel (`trillium.kernels.gguf_cpu`), which reads only the blocks
(int8 or float32 activations: `GgufLinear.activations`, from load_model's
`gguf_activations`; with int8 the C side itself picks its fused pass up to 8 rows and its GEMM above).
Larger batches (prefill) with int8 activations stay on `gguf_cpu.matmul`, i.e. the int8 GEMM
(gguf_cpu.c's "many rows" kernel: the weight codes repacked per call so one VNNI
instruction serves 16 output channels; ~3x dequantize + oneDNN at 1 thread,
bench/quant_matmul.py --prefill; the decode kernel's bits, so a row's
logits do not depend on its step's size); with float32 activations, or
where that GEMM has no AVX-512 VNNI path, they dequantize the blocks once
into a temporary float32 matrix and run oneDNN.

Tensor parallel: each rank's blocks are the packed rows / whole blocks of
its slice (gguf_tensor_parallel.py), so the same kernel runs on the shard;
a packed o_proj / down_proj takes the row-parallel layer's `group` and
all-reduces its partial product (`partial` / `reduce`, as llama.Linear).

NOTE: `reload_weights` refills a packed projection through `install_packed`
(a GGUF of the same formats is copied into the blocks). The executor's live
updates carry float tensors, and float tensors for a packed
projection -- or for the embedding a packed head was copied from -- are
refused before anything is copied (`packed_format_of`, used by the executor's
weight validator), since they would leave the blocks stale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch
from torch import nn

from trillium.kernels import gguf_cpu, native_ops, padded_rows
from trillium.models.gguf_checkpoint import PackedTensor
from trillium.models.llama import Linear, linear

if TYPE_CHECKING:
    from trillium.models.llama import LlamaForCausalLM

# Activation rows above which the blocks are dequantized and oneDNN's float GEMM runs: 32 with float32
# activations; 64 with int8 ones, whose kernel still beats dequantize + GEMM there (SmolLM2's shapes,
# 2 threads: qkv 1.3x, down 1.2x, gate_up 1.3x, the LM head 2.9x at 64 rows; even at 96 on qkv).
DEQUANTIZE_ROWS = 32
DEQUANTIZE_ROWS_INT8 = 64
# Module names (last part) that may be packed: their forward is their only use of the weight.
_PACKABLE_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


class GgufLinear(nn.Module):
    """y = x @ W^T (+ bias) with W in GGUF blocks; float32 x and y on the CPU.

    `activations` (gguf_cpu.INT8 / FLOAT32): how the packed kernel multiplies small batches -- int8
    activation blocks and integer dots (llama.cpp's way), or float32 (exact dequantize-then-matmul).
    A format without an int8 kernel (the K-quants) runs float32 whatever was asked."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, in_features: int, bias: torch.Tensor | None,
                 activations: str = gguf_cpu.FLOAT32) -> None:
        super().__init__()
        self.ggml_type, self.in_features, self.out_features = ggml_type, in_features, blocks.shape[0]
        gguf_cpu.check_activations(activations)
        self.activations = activations if ggml_type in gguf_cpu.INT8_TYPES else gguf_cpu.FLOAT32
        self.register_buffer("blocks", blocks)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # Tensor parallel: the TpGroup of a row-parallel shard (its bias is rank 0's only), else None.
        self.group = None

    @property
    def format_name(self) -> str:
        return gguf_cpu.FORMAT_NAMES[self.ggml_type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's product (all of it without tensor parallelism)."""
        flat = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():  # the same kernels behind one opaque op; the packed rows from C++
            native = native_ops.loaded() and flat.shape[0] <= packed_rows(self.activations)  # kernels/native_ops.py
            if native:  # int8 activations as a bool (native_ops.py says why)
                out = torch.ops.trillium_native.gguf_linear(flat, self.blocks, self.ggml_type, self.in_features,
                                                            self.bias, self.activations == gguf_cpu.INT8)
            else:
                out = torch.ops.trillium.gguf_linear(flat, self.blocks, self.ggml_type, self.in_features, self.bias,
                                                     self.activations)
        else:
            out = _gguf_linear(flat, self.blocks, self.ggml_type, self.in_features, self.bias, self.activations)
        return out.view(*x.shape[:-1], self.out_features)

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        """Row-parallel (o_proj / down_proj under tensor parallelism: `group` set): the ranks' sum."""
        return out if self.group is None else self.group.all_reduce(out)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format_name}, "
                f"activations={self.activations}")


def _gguf_linear(x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, in_features: int,
                 bias: torch.Tensor | None, activations: str) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias): the packed kernels up to DEQUANTIZE_ROWS rows (float32 activations) or
    DEQUANTIZE_ROWS_INT8 (int8), and at any row count with int8 where the int8 GEMM's AVX-512 VNNI path
    built (`gguf_cpu.matmul` itself takes the fused pass up to 8 rows, the GEMM above); more rows
    otherwise (prefill): dequantize + oneDNN (float32, exact)."""
    if x.shape[0] > packed_rows(activations) and not (activations == gguf_cpu.INT8
                                                        and gguf_cpu.gemm_int8_vectorized()):
        return linear(x, gguf_cpu.dequantize(blocks, ggml_type, in_features), bias)
    # compiled decode's padding rows cost FMAs here: skipped (kernels/padded_rows.py)
    out = padded_rows.skip_padding(x, blocks.shape[0], lambda live: gguf_cpu.matmul(live, blocks, ggml_type, in_features,
                                                                                    activations))
    if bias is not None:
        out += bias
    return out


def packed_rows(activations: str) -> int:
    """Rows up to which the packed decode kernel (and trillium_native::gguf_linear) serves every format
    and build (more: dequantize + oneDNN, or with int8 the int8 GEMM where it is vectorized)."""
    return DEQUANTIZE_ROWS_INT8 if activations == gguf_cpu.INT8 else DEQUANTIZE_ROWS


# WHY an op of our own (as llama.py's trillium::cpu_linear): the kernel is a ctypes call Dynamo
# cannot trace, so compiled decode (executor/compiled_decode.py) sees the packed projection as one
# opaque op; its blocks are a graph input (a buffer), so a reload that copies into them is seen on
# the next step.
_LIB = torch.library.Library("trillium", "FRAGMENT")
_LIB.define("gguf_linear(Tensor x, Tensor blocks, int ggml_type, int in_features, Tensor? bias, str activations) "
            "-> Tensor")
_LIB.impl("gguf_linear", _gguf_linear, "CPU")


@torch.library.register_fake("trillium::gguf_linear")
def _(x, blocks, ggml_type, in_features, bias, activations):
    return x.new_empty((x.shape[0], blocks.shape[0]))


@attrs.define
class PackedReport:
    """What `install_packed` did: packed module -> format; HF weight -> why it was dequantized."""

    packed: dict[str, str] = attrs.field(factory=dict)
    dequantized: dict[str, str] = attrs.field(factory=dict)
    activations: dict[str, str] = attrs.field(factory=dict)  # packed module -> its kernel's activations

    def summary(self) -> str:
        formats: dict[str, int] = {}
        for fmt in self.packed.values():
            formats[fmt] = formats.get(fmt, 0) + 1
        kept = ", ".join(f"{n} {fmt}" for fmt, n in sorted(formats.items())) or "none"
        out = f"GGUF weights kept packed: {len(self.packed)} projections ({kept})"
        modes: dict[str, set[str]] = {}
        for module, mode in self.activations.items():
            modes.setdefault(mode, set()).add(self.packed[module])
        if modes:
            out += "; activations " + ", ".join(f"{mode} ({', '.join(sorted(fmts))})" for mode, fmts in sorted(modes.items()))
        if gguf_cpu.INT8 in modes:  # which kernels the int8 batches get here
            out += (f"; int8 fused pass up to {gguf_cpu.FUSED_MAX_ROWS} rows, GEMM above (AVX-512 VNNI)"
                    if gguf_cpu.gemm_int8_vectorized()
                    else "; no int8 GEMM here (no AVX-512 VNNI): int8 prefill dequantizes for oneDNN")
        if self.dequantized:
            reasons: dict[str, int] = {}
            for why in self.dequantized.values():
                reasons[why] = reasons.get(why, 0) + 1
            out += "; dequantized to float: " + "; ".join(f"{n} x {why}" for why, n in sorted(reasons.items()))
        return out


def packed_format_of(model: nn.Module, name: str) -> str | None:
    """The format of the packed projection a float HF weight `name` would write into, else None."""
    target = model.resolve_weight(name) if name != "lm_head.weight" else ("lm_head.weight", None)
    if target is None:
        return None
    module = target[0].rpartition(".")[0]
    if module == "model.embed_tokens" and model.config.tie_word_embeddings:
        module = "lm_head"  # the packed head is a copy of the embedding
    found = dict(model.named_modules()).get(module)
    return found.format_name if isinstance(found, GgufLinear) else None


def _target(model: "LlamaForCausalLM", name: str) -> tuple[str, int] | None:
    """(module name, first row) a packed HF weight would fill, or None if that module cannot be packed."""
    if name == "lm_head.weight":
        return "lm_head", 0  # tied or not: the head's matmul
    resolved = model.resolve_weight(name)
    if resolved is None:
        return None
    param, rows = resolved
    module, _, kind = param.rpartition(".")
    if kind != "weight" or module.rpartition(".")[2] not in _PACKABLE_MODULES:
        return None
    try:
        if not isinstance(model.get_submodule(module), (Linear, GgufLinear)):
            return None
    except AttributeError:  # no such module: load_weights names it
        return None
    return module, 0 if rows is None else rows[0]


def _module_rows(model: "LlamaForCausalLM", module_name: str) -> tuple[int, int]:
    if module_name == "lm_head" and model.lm_head is None:  # tied: the embedding's (this rank's) rows
        return getattr(model, "local_config", model.config).vocab_size, model.config.hidden_size
    module = model.get_submodule(module_name)
    return module.out_features, module.in_features


def _group(model: "LlamaForCausalLM", packed: dict[str, PackedTensor], report: PackedReport):
    """{module: [(first row, HF name, tensor)]} of modules fully covered by one format; the rest into `fallback`."""
    groups: dict[str, list[tuple[int, str, PackedTensor]]] = {}
    fallback: dict[str, PackedTensor] = {}
    for name, tensor in packed.items():
        target = _target(model, name)
        if target is None:
            fallback[name] = tensor
            report.dequantized[name] = f"{tensor.format_name} not a packable projection"
            continue
        groups.setdefault(target[0], []).append((target[1], name, tensor))
    ready = {}
    for module, parts in groups.items():
        parts.sort(key=lambda part: part[0])
        out_rows, in_features = _module_rows(model, module)
        types = {t.ggml_type for _, _, t in parts}
        starts = np.cumsum([0] + [t.shape[0] for _, _, t in parts[:-1]]).tolist()
        covered = [p[0] for p in parts] == starts and sum(t.shape[0] for _, _, t in parts) == out_rows
        if len(types) == 1 and covered and all(t.shape[1] == in_features for _, _, t in parts):
            ready[module] = parts
            continue
        why = "mixed formats in one fused projection" if len(types) > 1 else "partial projection"
        for _, name, tensor in parts:
            fallback[name] = tensor
            report.dequantized[name] = f"{tensor.format_name} {why}"
    return ready, fallback


@torch.no_grad()
def install_packed(
    model: "LlamaForCausalLM", packed: dict[str, PackedTensor], sliced: bool = False
) -> tuple[set[str], PackedReport]:
    """Make each projection fully covered by one packable format a `GgufLinear` (or refill one);
    load the other packed weights dequantized. Returns the HF names used and the report.
    `sliced`: the tensors are a tensor-parallel rank's slices (load_weights must not cut them again).
    New projections take `model.gguf_activations` (set by load_model; int8 when unset)."""
    report = PackedReport()
    activations = getattr(model, "gguf_activations", gguf_cpu.INT8)
    ready, fallback = _group(model, packed, report)
    used: set[str] = set()
    for module_name, parts in ready.items():
        blocks = torch.cat([t.blocks for _, _, t in parts]) if len(parts) > 1 else parts[0][2].blocks
        ggml_type, in_features = parts[0][2].ggml_type, parts[0][2].shape[1]
        tied_head = module_name == "lm_head" and model.lm_head is None
        current = None if tied_head else model.get_submodule(module_name)
        if isinstance(current, GgufLinear) and current.ggml_type == ggml_type and current.blocks.shape == blocks.shape:
            current.blocks.copy_(blocks)  # a reload of the same formats (update from disk, wake)
        else:
            bias = None if current is None else current.bias
            parent_name, _, child = module_name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            packed_linear = GgufLinear(blocks.contiguous(), ggml_type, in_features, bias, activations)
            group = getattr(current, "group", None)  # a row-parallel layer (tensor_parallel.py) keeps its sum
            if group is not None:
                packed_linear.group = group
            setattr(parent, child, packed_linear)
        report.packed[module_name] = gguf_cpu.FORMAT_NAMES[ggml_type]
        report.activations[module_name] = model.get_submodule(module_name).activations
        used.update(name for _, name, _ in parts)
    for name, tensor in fallback.items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            used.add(name)  # the embedding (loaded as float) is the head
            continue
        used |= model.load_weights([(name, tensor.dequantize())], **({"sliced": True} if sliced else {}))
    return used, report
