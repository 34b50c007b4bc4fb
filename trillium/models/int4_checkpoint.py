"""AWQ and GPTQ 4-bit safetensors checkpoints: their `quantization_config` and their packed tensors.

    read_quant_spec(hf config dict) -> QuantSpec | None        config.json's quantization_config, validated
    quant_spec_of(path) -> QuantSpec | None                     the same for a model directory (None: GGUF/float)
    Int4Weight.from_awq(qweight, qzeros, scales, group)         one projection, repacked (still 4 bits a weight)
    Int4Weight.from_gptq(qweight, qzeros, scales, g_idx, group, zero_offset)
    Int4Weight.cat(parts)                                       fused projections (q/k/v, gate/up): rows stacked

What the peers write and load (vLLM vllm/model_executor/layers/quantization/awq.py,
awq_triton.py, gptq.py, cpu_wna16.py; AutoAWQ awq/modules/linear/gemm.py `WQLinear_GEMM.from_linear`;
AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py `QuantLinear.pack`):

    AWQ "gemm"  qweight int32 [K, N/8]  packed along N; nibble i (bits 4i..4i+3) of a word holds
                                        column 8c + AWQ_ORDER[i], AWQ_ORDER = 0 2 4 6 1 3 5 7
                                        (so column j is nibble AWQ_REVERSE[j], 0 4 1 5 2 6 3 7)
                qzeros int32 [K/g, N/8] the same packing;  scales fp16 [K/g, N];  w = (q - z) * s
    GPTQ        qweight int32 [K/8, N]  packed along K; nibble i of row r holds input 8r + i
                qzeros int32 [K/g, N/8] packed along N in plain order; scales [K/g, N]
                g_idx int32 [K]         the group of each input (act-order / desc_act: not k // g)
                checkpoint_format "gptq" (v1, AutoGPTQ): the stored zero is z - 1, readers add 1
                (vLLM csrc/quantization/gptq/q_gemm.cu `zero_offset = use_v2_format ? 0 : 1`);
                "gptq_v2" (GPTQModel): z as is.  w = (q - z) * s[g_idx[k]]

Both are repacked at load (as vLLM's CPU path `cpu_wna16.py` repacks AWQ) into the layout the CPU
kernel reads (trillium/kernels/int4_cpu.c): nibbles row-major per output channel and per group the
float32 pair (s, -z * s). Act-order inputs are sorted by group once (`perm`); the layer gathers its
input columns in that order, so each group is again a run of `group` inputs, as exllama's
`gptq_shuffle` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import torch

SUPPORTED_METHODS = ("awq", "gptq")
SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)
SUPPORTED_TEXT = ("AWQ (version gemm, zero_point) and GPTQ (checkpoint_format gptq or gptq_v2, desc_act or not), "
                  "4 bits, group_size 32, 64, 128 or -1")
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
QUANT_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@attrs.frozen
class QuantSpec:
    """One checkpoint's weight quantization (config.json `quantization_config`)."""

    method: str  # "awq" | "gptq" (vLLM's --quantization names)
    group_size: int  # -1: one group per input row (per channel)
    desc_act: bool = False
    zero_offset: int = 0  # added to stored zeros: 1 for GPTQ v1 checkpoints
    checkpoint_format: str = ""

    def describe(self) -> str:
        """e.g. "AWQ int4 g128", "GPTQ v2 int4 g128 desc_act" (the layers' format_name)."""
        version = {"gptq": " v1", "gptq_v2": " v2"}.get(self.checkpoint_format, "")
        return f"{self.method.upper()}{version} int4 g{self.group_size}{' desc_act' if self.desc_act else ''}"


def _refuse(what: str) -> ValueError:
    return ValueError(f"{what}: not supported; Trillium loads {SUPPORTED_TEXT} safetensors checkpoints")


def read_quant_spec(hf: dict[str, Any]) -> QuantSpec | None:
    """The checkpoint's QuantSpec, None for a float checkpoint; ValueError naming what is unsupported."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in SUPPORTED_METHODS:
        raise _refuse(f"checkpoint quantization {method or '(no quant_method)'!r}")
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    if bits != 4:
        raise _refuse(f"{method} with bits={bits}")
    if group not in SUPPORTED_GROUP_SIZES:
        raise _refuse(f"{method} with group_size={group}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse(f"awq version {version!r} (its packing differs from gemm's)")
        if not qc.get("zero_point", True):
            raise _refuse("awq with zero_point=false")
        return QuantSpec("awq", group)
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq")) or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2") or qc.get("is_marlin_format"):
        raise _refuse(f"gptq checkpoint_format {'marlin' if qc.get('is_marlin_format') else fmt!r}")
    if qc.get("dynamic"):
        raise _refuse("gptq with per-module `dynamic` overrides")
    if qc.get("lm_head"):
        raise _refuse("gptq with a quantized lm_head")
    return QuantSpec("gptq", group, bool(qc.get("desc_act", False)), 0 if fmt == "gptq_v2" else 1, fmt)


def quant_spec_of(path: str | Path) -> QuantSpec | None:
    """`read_quant_spec` of a model directory's config.json (None where there is none: GGUF, a file)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    return read_quant_spec(json.loads(config.read_text()))


def _unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """int32 [R, C/8] packed along columns -> uint8 [R, C]; `order[j]`: the nibble holding column j of 8."""
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 0xF  # [R, C/8, 8], nibble i at [..., i]
    if order is not None:
        nibbles = nibbles[..., list(order)]
    return nibbles.reshape(packed.shape[0], -1).to(torch.uint8)


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R/8, C] packed along rows (GPTQ's qweight) -> uint8 [R, C]."""
    nibbles = (packed.to(torch.int32).unsqueeze(1) >> _SHIFTS.view(1, 8, 1)) & 0xF  # [R/8, 8, C]
    return nibbles.reshape(-1, packed.shape[1]).to(torch.uint8)


@attrs.define
class Int4Weight:
    """One (or a fused stack of) int4 projection(s) in the kernel's layout.

    qs [N, K/2] uint8, sz [N, K/group, 2] float32, perm [K] int64 or None (act order: input k' of
    the packed rows is input perm[k'] of the layer).
    """

    qs: torch.Tensor
    sz: torch.Tensor
    group: int
    perm: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @property
    def in_features(self) -> int:
        return self.qs.shape[1] * 2

    @classmethod
    def build(cls, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group: int,
              g_idx: torch.Tensor | None = None) -> "Int4Weight":
        """From q uint8 [K, N], z [K/group, N] (true zero points), s [K/group, N], g_idx [K] or None."""
        k, n = q.shape
        if k % group or k % 32:
            raise ValueError(f"in_features {k} must be a multiple of the group size {group} and of 32")
        if tuple(z.shape) != (k // group, n) or tuple(s.shape) != (k // group, n):
            raise ValueError(f"zeros {tuple(z.shape)} / scales {tuple(s.shape)} do not fit a [{k}, {n}] "
                             f"weight in groups of {group}")
        perm = None
        if g_idx is not None:
            g_idx = g_idx.to(torch.int64)
            natural = torch.arange(k) // group
            if not torch.equal(g_idx, natural):
                perm = torch.argsort(g_idx, stable=True)
                if not torch.equal(g_idx[perm], natural):
                    raise ValueError(f"g_idx does not put exactly {group} inputs in each of {k // group} groups")
                q = q[perm]
        q_t = q.t().contiguous().view(n, k // 32, 2, 16)
        qs = (q_t[:, :, 0, :] | (q_t[:, :, 1, :] << 4)).reshape(n, k // 2).contiguous()
        scale = s.to(torch.float32).t()
        sz = torch.stack([scale, -(z.to(torch.float32).t() * scale)], dim=-1).contiguous()
        return cls(qs, sz, group, perm)

    @classmethod
    def from_awq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int):
        q = _unpack_cols(qweight, AWQ_REVERSE_ORDER)
        return cls.build(q, _unpack_cols(qzeros, AWQ_REVERSE_ORDER), scales, _group(group, q.shape[0]))

    @classmethod
    def from_gptq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  g_idx: torch.Tensor | None, group: int, zero_offset: int):
        q = _unpack_rows(qweight)
        z = _unpack_cols(qzeros, None).to(torch.int32) + zero_offset
        return cls.build(q, z, scales, _group(group, q.shape[0]), g_idx)

    @staticmethod
    def cat(parts: list["Int4Weight"]) -> "Int4Weight":
        """Output rows stacked (every part reads the same inputs: same K, group and input order)."""
        first = parts[0]
        for part in parts[1:]:
            same_perm = (part.perm is None) == (first.perm is None) and (
                part.perm is None or torch.equal(part.perm, first.perm))
            if part.in_features != first.in_features or part.group != first.group or not same_perm:
                raise ValueError("fused projections must share in_features, group size and act-order g_idx")
        if len(parts) == 1:
            return first
        return Int4Weight(torch.cat([p.qs for p in parts]), torch.cat([p.sz for p in parts]), first.group, first.perm)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] in the layer's own input order (torch; the kernel's `dequantize` is faster)."""
        n, k = self.out_features, self.in_features
        lo, hi = self.qs & 15, self.qs >> 4
        q = torch.stack([lo.view(n, k // 32, 16), hi.view(n, k // 32, 16)], dim=2).reshape(n, k).to(torch.float32)
        s, c = (t.repeat_interleave(self.group, dim=1) for t in self.sz.unbind(-1))
        w = q * s + c
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


def _group(group: int, in_features: int) -> int:
    return in_features if group == -1 else group


def int4_weight(spec: QuantSpec, tensors: dict[str, torch.Tensor], module: str) -> Int4Weight:
    """The Int4Weight of one checkpoint module from its {"qweight", "qzeros", "scales", ["g_idx"]}."""
    missing = [k for k in ("qweight", "qzeros", "scales") if k not in tensors]
    if missing:
        raise ValueError(f"{module}: {spec.method} checkpoint lacks {', '.join(missing)}")
    if spec.method == "awq":
        return Int4Weight.from_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], spec.group_size)
    return Int4Weight.from_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx"),
                                spec.group_size, spec.zero_offset)
