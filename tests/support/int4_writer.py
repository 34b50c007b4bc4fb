"""AWQ / GPTQ 4-bit checkpoints written the way the peers' packers write them, and read back the way
vLLM's reference paths read them -- independent of trillium/models/int4_checkpoint.py.

    quantize_groups(w [N, K], group, sym, g_idx=None) -> (q [K, N], zeros [G, N], scales [G, N] fp16)
    pack_awq(q, zeros, scales)  -> {"qweight", "qzeros", "scales"}         AutoAWQ WQLinear_GEMM.from_linear
    pack_gptq(q, zeros, scales, g_idx, v2) -> {"qweight", "qzeros", "scales", "g_idx"}   AutoGPTQ QuantLinear.pack
    dequantize_awq(tensors, group) / dequantize_gptq(tensors, v2) -> float32 [N, K]      the readers' formula
    write_int4_checkpoint(float_dir, out_dir, method, ...) -> (out_dir, dequantized float dir)

Mirrors: casper-hansen/AutoAWQ awq/modules/linear/gemm.py (`order_map = [0, 2, 4, 6, 1, 3, 5, 7]`,
nibble i of a word holds column 8c + order_map[i]; zeros packed the same); AutoGPTQ/AutoGPTQ
auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py `pack` (qweight rows hold 8 consecutive inputs, nibble
j-i for input j; `zeros -= 1` before packing: the v1 convention); vLLM
vllm/model_executor/layers/quantization/awq_triton.py (reverse order 0 4 1 5 2 6 3 7, (q - z) * s) and
csrc/quantization/gptq/q_gemm.cu (`zero_offset = use_v2_format ? 0 : 1`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_groups(w: torch.Tensor, group: int, sym: bool, g_idx: torch.Tensor | None = None):
    """Round-to-nearest 4-bit per group of inputs: q [K, N] int, zeros [G, N] int, scales [G, N] fp16.
    `g_idx` [K]: the group of each input (act order); default k // group."""
    n, k = w.shape
    g_idx = torch.arange(k) // group if g_idx is None else g_idx.long()
    groups = k // group
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.min(dim=1).values.clamp(max=0), cols.max(dim=1).values.clamp(min=0)
        if sym:
            scale = torch.maximum(hi.abs(), lo.abs()) * 2 / 15
            zero = torch.full((n,), 8, dtype=torch.int64)
        else:
            scale = (hi - lo) / 15
            zero = torch.round(-lo / scale).long().clamp(0, 15)
        scales[g], zeros[g] = scale, zero
    scales = scales.half()  # the stored scale is what the readers multiply by
    s = scales.float()[g_idx]  # [K, N]
    q = torch.round(w.t() / s + zeros[g_idx]).clamp(0, 15).long()
    return q, zeros, scales


def _pack_words(values: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """[R, C] nibbles -> int32 [R, C/8]: nibble i of word c holds column 8c + order[i]."""
    r, c = values.shape
    v = values.long().view(r, c // 8, 8)
    word = torch.zeros(r, c // 8, dtype=torch.int64)
    for i in range(8):
        word |= (v[:, :, order[i] if order else i] & 0xF) << (4 * i)
    return _to_int32(word)


def _to_int32(word: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> the int32 the checkpoints store."""
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def pack_awq(q, zeros, scales) -> dict[str, torch.Tensor]:
    return {"qweight": _pack_words(q, AWQ_ORDER), "qzeros": _pack_words(zeros, AWQ_ORDER), "scales": scales}


def pack_gptq(q, zeros, scales, g_idx: torch.Tensor, v2: bool) -> dict[str, torch.Tensor]:
    k, n = q.shape
    rows = q.long().view(k // 8, 8, n)
    word = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        word |= rows[:, j, :] << (4 * j)
    stored = zeros if v2 else zeros - 1  # v1: AutoGPTQ stores z - 1 (sym: 7 for z = 8)
    assert int(stored.min()) >= 0, "v1 cannot store a zero point of 0 (AutoGPTQ's own limitation)"
    return {"qweight": _to_int32(word), "qzeros": _pack_words(stored, None),
            "scales": scales, "g_idx": g_idx.to(torch.int32)}


def _nibbles(word: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> int [..., C, 8], nibble i at [..., i]."""
    return (word.long().unsqueeze(-1) >> (4 * torch.arange(8))) & 0xF


def dequantize_awq(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    reverse = [AWQ_ORDER.index(j) for j in range(8)]  # column j lives in nibble reverse[j]
    q = _nibbles(t["qweight"])[..., reverse].flatten(1)  # [K, N]
    z = _nibbles(t["qzeros"])[..., reverse].flatten(1)  # [G, N]
    s = t["scales"].float()
    g = torch.arange(q.shape[0]) // group
    return ((q - z[g]).float() * s[g]).t().contiguous()


def dequantize_gptq(t: dict[str, torch.Tensor], v2: bool) -> torch.Tensor:
    q = _nibbles(t["qweight"]).permute(0, 2, 1).reshape(-1, t["qweight"].shape[1])  # [K, N]
    z = _nibbles(t["qzeros"]).flatten(1) + (0 if v2 else 1)
    g = t["g_idx"].long()
    return ((q - z[g]).float() * t["scales"].float()[g]).t().contiguous()


def write_int4_checkpoint(src: Path, out: Path, method: str, *, group: int = 128, desc_act: bool = False,
                          v2: bool = False, sym: bool | None = None, skip: tuple[str, ...] = (),
                          seed: int = 0) -> tuple[Path, Path]:
    """Quantize `src`'s projections (not embeddings / norms / lm_head) into an AWQ or GPTQ checkpoint at
    `out`, and write `out`-float: the same model with the dequantized weights (the reference).
    `skip`: HF module names left in float (AutoAWQ's modules_to_not_convert)."""
    sym = (method == "gptq" and not v2) if sym is None else sym
    floats = load_file(str(src / "model.safetensors"))
    quantized, reference = {}, {}
    gen = torch.Generator().manual_seed(seed)
    perms: dict[str, torch.Tensor] = {}  # act order: one permutation per input (shared by q/k/v, gate/up)
    for name, w in floats.items():
        module = name.rpartition(".")[0]
        if not name.endswith(".weight") or module.rpartition(".")[2] not in PROJECTIONS or module in skip:
            quantized[name], reference[name] = w.half() if w.is_floating_point() else w, w.half().float()
            continue
        k = w.shape[1]
        g_idx = None
        if desc_act:
            key = module.rpartition(".")[0] + str(k)
            perms.setdefault(key, torch.randperm(k, generator=gen))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perms[key]] = torch.arange(k) // group  # input perms[key][j] is j-th in quantization order
        q, zeros, scales = quantize_groups(w, group, sym, g_idx)
        if method == "awq":
            tensors = pack_awq(q, zeros, scales)
            reference[name] = dequantize_awq(tensors, group)
        else:
            tensors = pack_gptq(q, zeros, scales, torch.arange(k) // group if g_idx is None else g_idx, v2)
            reference[name] = dequantize_gptq(tensors, v2)
        quantized.update({f"{module}.{kind}": t for kind, t in tensors.items()})
    config = json.loads((src / "config.json").read_text())
    if method == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": [m.rpartition(".")[2] for m in skip] or None}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    for path, tensors, extra in ((out, quantized, {"quantization_config": qc, "torch_dtype": "float16"}),
                                 (out.with_name(out.name + "-float"), reference, {})):
        shutil.copytree(src, path, dirs_exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps({**config, **extra}, indent=1))
    return out, out.with_name(out.name + "-float")
