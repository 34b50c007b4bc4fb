"""Rotary position embedding tables: the `cos_sin_cache` the kernels read.

`build_cos_sin_cache(config)` returns a float32 tensor [max_positions, D]
whose row p is [cos(p * inv_freq) | sin(p * inv_freq)] (each half D/2 wide),
the layout `trillium.kernels.rotary_embedding` expects (neox / rotate-half
style, as Hugging Face Llama applies it).

Scaling types follow transformers' `modeling_rope_utils` exactly, so the
table equals what HF computes (same float32 ops in the same order):

    default   inv_freq = 1 / theta^(2i/D)
    linear    inv_freq / factor
    dynamic   NTK-aware: default inside max_position_embeddings (as HF);
              beyond it, vLLM's choice (see `_dynamic_ntk_table`)
    llama3    Llama 3.1 band-wise scaling
    yarn      YaRN with its attention factor folded into cos and sin
    freq_factors  per-frequency divisors (GGUF `rope_freqs.weight`)

Config keys: transformers 5 writes `rope_parameters` (with `rope_type` and
`rope_theta` inside); older configs write `rope_scaling` (with `type` or
`rope_type`) next to a top-level `rope_theta`. `parse_rope_config` accepts
both and returns (theta, scaling dict or None).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trillium.models.config import ModelConfig

DEFAULT_ROPE_THETA = 10000.0
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "freq_factors")


def parse_rope_config(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalized scaling dict or None) from an HF config dict.

    The scaling dict always carries `rope_type` and never `rope_theta` or
    the legacy `type` key. None means plain (default) RoPE.
    """
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    params = dict(params)
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = hf_config.get("rope_theta", DEFAULT_ROPE_THETA)
    legacy_type = params.pop("type", None)
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"rope type {rope_type!r} is not supported ({SUPPORTED_ROPE_TYPES})")
    params.pop("partial_rotary_factor", None)  # NOTE: Llama-family models rotate the full head.
    return float(theta), {"rope_type": rope_type, **params}


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    # Same expression (int64 arange, then float) as transformers, so values match bit for bit.
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    return 1.0 / (theta**exponent)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    theta: float, dim: int, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    factor = scaling.get("factor")
    original_max = scaling.get("original_max_position_embeddings") or max_position_embeddings
    if factor is None:
        factor = max_position_embeddings / original_max

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _table(inv_freq: torch.Tensor, positions: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    # HF computes freqs = inv_freq @ positions (a k=1 matmul, i.e. one float32 product).
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat((cos, sin), dim=-1)


def _dynamic_ntk_table(
    theta: float, dim: int, factor: float, max_position_embeddings: int, num_positions: int
) -> torch.Tensor:
    """Dynamic NTK: HF keeps the base inside max_position_embeddings.

    WHY two regions: HF recomputes the base from the *current sequence
    length* once it passes max_position_embeddings, which a position-indexed
    table cannot express. Positions inside the trained window use the plain
    base (identical to HF for every sequence that fits); positions past it
    use the base for the full extended table length, as vLLM does.
    """
    positions = torch.arange(num_positions)
    table = _table(_base_inv_freq(theta, dim), positions)
    if num_positions > max_position_embeddings:
        seq_len = num_positions
        base = theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        extended = _table(_base_inv_freq(base, dim), positions[max_position_embeddings:])
        table[max_position_embeddings:] = extended
    return table


def default_num_positions(config: "ModelConfig") -> int:
    """Table length: max_position_embeddings, times the factor for linear/dynamic."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") in ("linear", "dynamic"):
        return int(config.max_position_embeddings * float(scaling["factor"]))
    return int(config.max_position_embeddings)


def build_cos_sin_cache(
    config: "ModelConfig",
    num_positions: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """[num_positions, head_dim] float32 table of [cos | sin] for `config`."""
    if num_positions is None:
        num_positions = default_num_positions(config)
    dim, theta = config.head_dim, config.rope_theta
    scaling = config.rope_scaling or {"rope_type": "default"}
    rope_type = scaling["rope_type"]
    positions = torch.arange(num_positions)
    if rope_type == "default":
        table = _table(_base_inv_freq(theta, dim), positions)
    elif rope_type == "linear":
        table = _table(_base_inv_freq(theta, dim) / scaling["factor"], positions)
    elif rope_type == "dynamic":
        table = _dynamic_ntk_table(
            theta, dim, float(scaling["factor"]), config.max_position_embeddings, num_positions
        )
    elif rope_type == "llama3":
        table = _table(_llama3_inv_freq(_base_inv_freq(theta, dim), scaling), positions)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(theta, dim, scaling, config.max_position_embeddings)
        table = _table(inv_freq, positions, attention_factor)
    elif rope_type == "freq_factors":
        # llama.cpp's ggml_rope divides each frequency's angle by its factor.
        divisors = torch.tensor(scaling["freq_factors"], dtype=torch.float32)
        table = _table(_base_inv_freq(theta, dim) / divisors, positions)
    else:
        raise NotImplementedError(f"rope type {rope_type!r} is not supported")
    return table.to(device)
