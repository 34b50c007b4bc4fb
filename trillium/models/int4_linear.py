"""AWQ / GPTQ projections kept at 4 bits: the layer multiplies the packed nibbles directly.

    Int4Linear(Int4Weight, bias, format_name)                       a `Linear` whose weight stays int4
    install_int4(model, spec, {HF module: {kind: tensor}}, packed)  swap Linears for Int4Linears (or refill)

The loader (`loader.py`) collects each quantized module's qweight / qzeros /
scales / g_idx (int4_checkpoint.py reads them) and calls `install_int4`
after the float tensors (embeddings, norms, biases, an lm_head the
checkpoint keeps in float) are in. The HF modules of one fused projection
(q/k/v -> `qkv_proj`, gate/up -> `gate_up_proj`) are stacked by rows; a
projection only partly quantized (some of its parts listed in
`modules_to_not_convert`) is dequantized into the float parameter, and the
report says so. With `packed=False` (another dtype or device, or no C
compiler) every quantized module is dequantized into its float parameter.

Forward: up to `DEQUANTIZE_ROWS` activation rows (decode, small batches) run
the int4 kernel (`trillium.kernels.int4_cpu`), which reads only the packed
bytes; larger batches (prefill) dequantize into a temporary float32 matrix
and run oneDNN (the same split as packed_linear.py's GGUF layers). An
act-order (GPTQ desc_act) layer first gathers its input columns in group
order (`perm`), a copy of the activations, never of the weight.

NOTE: `loader.reload_weights` refills the Int4Linears in place from a
checkpoint of the same shapes. Live updates (executor/weights.py) carry float
tensors, which have no parameter to land in here: the executor's weight
validator refuses them (`int4_format_of`) with a 400 before anything is
copied, and `load_weights` raises KeyError naming the weight.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from trillium.kernels import int4_cpu
from trillium.models.int4_checkpoint import Int4Weight, QuantSpec, int4_weight
from trillium.models.llama import Linear, linear

if TYPE_CHECKING:
    from trillium.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

# Activation rows above which the weight is dequantized and oneDNN's float GEMM runs.
DEQUANTIZE_ROWS = 32


class Int4Linear(nn.Module):
    """y = x @ W^T (+ bias) with W = (q - z) * s in 4-bit groups; float32 activations on the CPU."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, format_name: str) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group = weight.in_features, weight.out_features, weight.group
        self.format_name = format_name
        self.register_buffer("qs", weight.qs)
        self.register_buffer("sz", weight.sz)
        self.register_buffer("perm", weight.perm)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        """float32 [N, K] in the packed (group-sorted) input order."""
        return int4_cpu.dequantize(self.qs, self.sz, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.perm is not None:
            flat = flat.index_select(1, self.perm)
        if flat.shape[0] > DEQUANTIZE_ROWS:
            out = linear(flat, self.dequantized(), self.bias)
        else:
            out = int4_cpu.matmul(flat, self.qs, self.sz, self.group)
            if self.bias is not None:
                out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def refill(self, weight: Int4Weight) -> bool:
        """Copy a same-shaped weight into the buffers (a reload); False if the shapes differ."""
        same_perm = (weight.perm is None) == (self.perm is None)
        if not same_perm or weight.qs.shape != self.qs.shape or weight.sz.shape != self.sz.shape:
            return False
        self.qs.copy_(weight.qs)
        self.sz.copy_(weight.sz)
        if self.perm is not None:
            self.perm.copy_(weight.perm)
        return True

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format_name}"


def int4_format_of(model: nn.Module, name: str) -> str | None:
    """The format of the Int4Linear a float HF weight `name` would write into, else None."""
    resolved = model.resolve_weight(name)
    if resolved is None:
        return None
    found = dict(model.named_modules()).get(resolved[0].rpartition(".")[0])
    return found.format_name if isinstance(found, Int4Linear) else None


def _target(model: "LlamaForCausalLM", hf_module: str) -> tuple[str, int]:
    """(our module name, first output row) the HF module's weight fills; ValueError where int4 cannot go."""
    resolved = model.resolve_weight(f"{hf_module}.weight")
    if resolved is None:
        raise ValueError(f"{hf_module}: quantized weights for a module the model does not have")
    param, rows = resolved
    module = param.rpartition(".")[0]
    try:
        found = model.get_submodule(module)
    except AttributeError:
        raise ValueError(f"{hf_module}: quantized weights for a module the model does not have") from None
    if not isinstance(found, (Linear, Int4Linear)):
        raise ValueError(f"{hf_module}: int4 weights for a {type(found).__name__} are not supported "
                         "(only the linear projections: attention, dense MLP, an untied lm_head)")
    return module, 0 if rows is None else rows[0]


def _out_features(model: "LlamaForCausalLM", module: str) -> int:
    return model.get_submodule(module).out_features


@torch.no_grad()
def install_int4(model: "LlamaForCausalLM", spec: QuantSpec, modules: dict[str, dict[str, torch.Tensor]],
                 packed: bool) -> set[str]:
    """Make each fully quantized projection an Int4Linear (or refill it); dequantize the rest into their
    float parameters. Returns the HF weight names (`<module>.weight`) now loaded; logs a summary."""
    groups: dict[str, list[tuple[int, str, Int4Weight]]] = {}
    for hf_module, tensors in modules.items():
        target, row = _target(model, hf_module)
        groups.setdefault(target, []).append((row, hf_module, int4_weight(spec, tensors, hf_module)))
    fmt = spec.describe()
    kept, floated = 0, []
    for target, parts in groups.items():
        parts.sort(key=lambda part: part[0])
        starts, total = [], 0
        for _, _, weight in parts:
            starts.append(total)
            total += weight.out_features
        whole = [p[0] for p in parts] == starts and total == _out_features(model, target)
        if packed and whole:
            _install(model, target, Int4Weight.cat([w for _, _, w in parts]), fmt)
            kept += 1
            continue
        if packed:
            floated.append(target)
        for _, hf_module, weight in parts:
            model.load_weights([(f"{hf_module}.weight", weight.dequantize())])
    summary = f"{spec.method.upper()} weights kept packed: {kept} projections ({fmt})"
    if floated:
        summary += f"; dequantized to float (only partly quantized): {', '.join(sorted(floated))}"
    elif not packed:
        summary = f"{spec.method.upper()} weights dequantized to float: {len(groups)} projections ({fmt})"
    log.info(summary)
    return {f"{hf_module}.weight" for hf_module in modules}


def _install(model: "LlamaForCausalLM", target: str, weight: Int4Weight, fmt: str) -> None:
    current = model.get_submodule(target)
    if isinstance(current, Int4Linear):
        if current.refill(weight):
            return
        raise ValueError(f"{target}: the checkpoint's int4 weight does not fit the loaded one")
    if current.in_features != weight.in_features:
        raise ValueError(f"{target}: int4 weight reads {weight.in_features} inputs, the model {current.in_features}")
    parent_name, _, child = target.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, Int4Linear(weight, current.bias, fmt))
