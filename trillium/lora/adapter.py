"""Read and validate a PEFT LoRA adapter directory.

    load_adapter(path, model_config, max_rank) -> LoRAAdapter

A PEFT directory holds `adapter_config.json` (r, lora_alpha,
target_modules, use_rslora, ...) and `adapter_model.safetensors` with, per
adapted Linear, `...layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`
[r, in] and `lora_B.weight` [out, r] (an adapter-name segment such as
`.lora_A.default.weight` is tolerated). The delta a module adds is
`scaling * x @ A.T @ B.T` with scaling = alpha / r, or alpha / sqrt(r)
under rsLoRA.

Phi-3 checkpoints fuse q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`),
so its adapters target those: each fused pair is split into its parts (the
same A, B's row slices), which adds exactly the fused delta. On
mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral) LoRA applies to
the attention projections only; an adapter touching an MLP or expert is
refused, naming the model.

Only safetensors is read, never pickle: a `.bin`-only adapter is refused.
Every problem (malformed or missing files, a rank over `max_rank`, a target
the model lacks or LoRA here does not support, a tensor of the wrong shape,
DoRA and the other PEFT variants whose forward differs) raises
`AdapterError`, a ValueError whose message names the file, tensor or key,
so the control plane can return it as a 400. Tensors stay on the CPU in the
adapter's dtype; `LoRASlots.load` moves them to the device.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open

from trillium.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")

# The HF Linear modules LoRA applies to, in a fixed order, with their parent.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {m: "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp" for m in LORA_MODULES}

_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# Phi-3's fused Linear modules -> the modules LoRA keeps per part (rows in this order).
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)
_FUSED_PARENT = {"qkv_proj": "self_attn", "gate_up_proj": "mlp"}

_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\."
    r"(?P<module>[A-Za-z0-9_]+)\.lora_(?P<kind>[AB])(?:\.[A-Za-z0-9_\-]+)?\.weight$"
)
# adapter_config.json keys whose non-default value changes the forward pass
# in ways the batched kernels do not implement.
_UNSUPPORTED_SETTINGS: dict[str, str] = {
    "use_dora": "DoRA (use_dora) is not supported",
    "lora_bias": "LoRA bias (lora_bias) is not supported",
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "target_parameters": "target_parameters is not supported",
    "layer_replication": "layer_replication is not supported",
    "trainable_token_indices": "trainable_token_indices is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
}


class AdapterError(ValueError):
    """A LoRA adapter that cannot be served; the message says why."""


@attrs.frozen(eq=False)
class LoRAWeights:
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]


@attrs.frozen(eq=False)
class LoRAAdapter:
    """A validated adapter: per (layer, HF module name) the raw A and B, plus its scaling.

    NOTE: scaling is not applied to B here; `LoRASlots.load` folds it in.
    """

    path: str
    rank: int
    lora_alpha: float
    use_rslora: bool
    scaling: float
    weights: Mapping[tuple[int, str], LoRAWeights] = attrs.field(repr=False)

    @property
    def target_modules(self) -> frozenset[str]:
        """HF module names (q_proj, ..., down_proj) this adapter changes in some layer."""
        return frozenset(module for _, module in self.weights)

    @property
    def num_bytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


def module_dims(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF module name -> (in_features, out_features) of that Linear in `config`'s model."""
    hidden, inter, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def lora_scaling(rank: int, lora_alpha: float, use_rslora: bool) -> float:
    """PEFT's scaling: alpha / sqrt(r) under rsLoRA, else alpha / r."""
    return lora_alpha / math.sqrt(rank) if use_rslora else lora_alpha / rank


def load_adapter(path: str | Path, model_config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read, validate and return the PEFT LoRA adapter in directory `path`.

    Raises AdapterError (a ValueError) for anything that makes it unservable
    on `model_config`'s model with slots of `max_rank`.
    """
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"LoRA adapter path {str(path)!r} is not a directory")
    config = _read_config(path)
    rank, alpha, use_rslora = _check_config(config, path, max_rank)
    _check_target_modules(config.get("target_modules"), model_config)
    weights = _read_weights(path, model_config, rank)
    if not weights:
        raise AdapterError(f"{path / WEIGHTS_FILE}: no LoRA weights found")
    return LoRAAdapter(
        path=str(path),
        rank=rank,
        lora_alpha=alpha,
        use_rslora=use_rslora,
        scaling=lora_scaling(rank, alpha, use_rslora),
        weights=weights,
    )


# ---- adapter_config.json ------------------------------------------------------


def _read_config(path: Path) -> dict[str, Any]:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"{path}: missing {CONFIG_FILE} (not a PEFT adapter directory)")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file}: expected a JSON object")
    return config


def _is_set(value: Any) -> bool:
    """True for a value that turns a PEFT option on (not None/False/empty)."""
    return value not in (None, False, "", [], {}, ())


def _check_config(config: dict[str, Any], path: Path, max_rank: int) -> tuple[int, float, bool]:
    """(r, lora_alpha, use_rslora) after checking every setting we depend on."""
    where = path / CONFIG_FILE
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"{where}: peft_type {peft_type!r} is not LORA")
    for key, reason in _UNSUPPORTED_SETTINGS.items():
        if _is_set(config.get(key)):
            raise AdapterError(f"{where}: {reason} (got {key}={config[key]!r})")
    bias = config.get("bias", "none")
    if bias != "none":
        raise AdapterError(f"{where}: bias={bias!r} is not supported (only 'none')")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"{where}: LoRA rank {rank} exceeds max_lora_rank {max_rank}")
    alpha = config.get("lora_alpha", 8)  # LoraConfig's default
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterError(f"{where}: use_rslora must be true or false, got {use_rslora!r}")
    return rank, float(alpha), use_rslora


def _moe_refusal(config: ModelConfig, what: str) -> AdapterError:
    return AdapterError(f"{what}: LoRA on the MLP / expert weights of mixture-of-experts model "
                        f"{config.architecture} is not supported (attention only: q_proj, k_proj, v_proj, o_proj)")  # fmt: skip


def _fused(config: ModelConfig) -> bool:
    return config.architecture in _FUSED_ARCHITECTURES


def _model_module_names(config: ModelConfig) -> list[str]:
    """Full HF module names of the model (the keys PEFT matches target_modules against)."""
    names = ["model", "model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head", "model.layers"]
    layer_children = [f"{parent}.{m}" for m, parent in _PARENT.items()]
    if _fused(config):
        unfused = {part for parts in _FUSED.values() for part in parts}
        layer_children = [c for c in layer_children if c.rpartition(".")[2] not in unfused]
        layer_children += [f"{_FUSED_PARENT[m]}.{m}" for m in _FUSED]
    layer_children += ["self_attn", "mlp", "input_layernorm", "post_attention_layernorm"]
    if config.qk_norm:
        layer_children += ["self_attn.q_norm", "self_attn.k_norm"]
    for i in range(config.num_layers):
        names.append(f"model.layers.{i}")
        names.extend(f"model.layers.{i}.{child}" for child in layer_children)
    return names


def _is_lora_module(name: str) -> bool:
    parent, _, leaf = name.rpartition(".")
    parents = {**_PARENT, **_FUSED_PARENT}
    return leaf in parents and parent.endswith(parents[leaf])


def _check_target_modules(targets: Any, config: ModelConfig) -> None:
    """Every target names a module of the model that LoRA supports here (PEFT's matching rules)."""
    supported = ", ".join(LORA_MODULES)
    moe = config.moe is not None
    if targets == "all-linear":
        if moe:
            raise _moe_refusal(config, "target_modules 'all-linear' includes the experts")
        return  # PEFT: every Linear but the output head, i.e. exactly LORA_MODULES
    names = _model_module_names(config)
    if isinstance(targets, str):
        try:
            pattern = re.compile(targets)
        except re.error as exc:
            raise AdapterError(f"target_modules regex {targets!r} is invalid: {exc}") from None
        matched = [n for n in names if pattern.fullmatch(n)]
        if moe and any(".mlp" in n for n in matched):
            raise _moe_refusal(config, f"target_modules {targets!r}")
        bad = [n for n in matched if not _is_lora_module(n)]
        if bad:
            raise AdapterError(f"target_modules {targets!r} matches {bad[0]!r}, which LoRA does not support "
                               f"(supported: {supported})")  # fmt: skip
        if not matched:
            raise AdapterError(f"target_modules {targets!r} matches no module of this {config.architecture}")
        return
    if not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"target_modules must be a non-empty list of names or a regex, got {targets!r}")
    for target in targets:
        if moe and (target.rpartition(".")[2] in _MLP_MODULES or "expert" in target or "mlp" in target):
            raise _moe_refusal(config, f"target module {target!r}")
        matched = [n for n in names if n == target or n.endswith("." + target)]
        if not matched:
            raise AdapterError(f"target module {target!r} does not exist in this {config.architecture} "
                               f"(supported: {supported})")  # fmt: skip
        if not all(_is_lora_module(n) for n in matched):
            raise AdapterError(f"target module {target!r} is not supported (supported: {supported})")


# ---- adapter_model.safetensors ---------------------------------------------------


def _weights_file(path: Path) -> Path:
    file = path / WEIGHTS_FILE
    if file.is_file():
        return file
    pickled = [name for name in _PICKLE_FILES if (path / name).exists()]
    if pickled:
        raise AdapterError(f"{path}: only {pickled[0]} found; pickle checkpoints are never loaded, "
                           f"convert the adapter to {WEIGHTS_FILE}")  # fmt: skip
    raise AdapterError(f"{path}: missing {WEIGHTS_FILE}")


def _parse_name(name: str, config: ModelConfig, file: Path) -> tuple[int, str, str]:
    """(layer, HF module, 'A' | 'B') for a tensor name; AdapterError for anything else."""
    if "lora_magnitude_vector" in name:
        raise AdapterError(f"{file}: {name!r} is a DoRA magnitude; DoRA is not supported")
    if config.moe is not None and (".mlp." in name or ".block_sparse_moe." in name):
        raise _moe_refusal(config, f"{file}: tensor {name!r}")
    match = _TENSOR_NAME.match(name)
    if match is None:
        raise AdapterError(f"{file}: tensor {name!r} is not a LoRA weight of a supported module "
                           f"({', '.join(LORA_MODULES)})")  # fmt: skip
    layer, parent, module = int(match["layer"]), match["parent"], match["module"]
    if _fused(config) and _FUSED_PARENT.get(module) == parent:
        pass  # split into its parts by _read_weights
    elif _PARENT.get(module) != parent:
        raise AdapterError(f"{file}: tensor {name!r} targets {parent}.{module}, which LoRA does not support")
    if layer >= config.num_layers:
        raise AdapterError(f"{file}: tensor {name!r} is for layer {layer}; the model has {config.num_layers}")
    return layer, module, match["kind"]


def _read_weights(path: Path, config: ModelConfig, rank: int) -> dict[tuple[int, str], LoRAWeights]:
    file = _weights_file(path)
    dims = module_dims(config)
    for fused, parts in _FUSED.items():
        dims[fused] = (dims[parts[0]][0], sum(dims[p][1] for p in parts))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                layer, module, kind = _parse_name(name, config, file)
                pair = halves.setdefault((layer, module), {})
                if kind in pair:
                    raise AdapterError(f"{file}: two lora_{kind} tensors for layer {layer} {module}")
                pair[kind] = f.get_tensor(name)
    except AdapterError:
        raise
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise AdapterError(f"{file}: cannot read safetensors ({exc})") from None
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        where = f"{file}: layer {layer} {module}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where}: has lora_{''.join(pair)} but not its pair")
        a, b = pair["A"], pair["B"]
        in_features, out_features = dims[module]
        for kind, tensor, expected in (("A", a, (rank, in_features)), ("B", b, (out_features, rank))):
            if not tensor.is_floating_point():
                raise AdapterError(f"{where}: lora_{kind} has dtype {tensor.dtype}, expected a float type")
            if tuple(tensor.shape) != expected:
                raise AdapterError(f"{where}: lora_{kind} has shape {tuple(tensor.shape)}, expected "
                                   f"{expected} (r={rank}, model in/out {in_features}/{out_features})")  # fmt: skip
        if module in _FUSED:
            start = 0
            for part in _FUSED[module]:
                rows = dims[part][1]
                weights[(layer, part)] = LoRAWeights(a=a, b=b[start : start + rows].contiguous())
                start += rows
        else:
            weights[(layer, module)] = LoRAWeights(a=a, b=b)
    return weights
