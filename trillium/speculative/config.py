"""`SpeculativeConfig`: vLLM's `--speculative-config` / `LLM(speculative_config=...)`.

Parsed once at start-up (`parse_speculative_config`) from a dict, a JSON
string or None; an unknown key or method is a start-up error naming it.
Frozen, part of `EngineConfig`, so every actor sees the same one.
"""

from __future__ import annotations

import json

import attrs

# Methods Trillium implements; vLLM's other names are refused by name.
METHODS = ("ngram",)
_NOT_IMPLEMENTED = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix",
                    "deepseek_mtp", "ngram_gpu")
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
# The deepest draft a step verifies (bounds the per-position loop of verify.py).
MAX_SPECULATIVE_TOKENS = 16


@attrs.frozen
class SpeculativeConfig:
    method: str = ""  # "" = speculative decoding off
    num_speculative_tokens: int = 0  # k: the most drafts proposed per request per step
    prompt_lookup_min: int = 0  # ngram: shortest suffix n-gram matched (resolved: vLLM's defaults)
    prompt_lookup_max: int = 0  # ngram: longest suffix n-gram matched

    @property
    def enabled(self) -> bool:
        return bool(self.method)


NO_SPECULATION = SpeculativeConfig()


def parse_speculative_config(value) -> SpeculativeConfig:
    """From None / "" (off), a SpeculativeConfig, a dict or its JSON text. ValueError names the problem."""
    if value is None or value == "" or value == {}:
        return NO_SPECULATION
    if isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: unsupported key(s) {', '.join(unknown)}; "
                         f"Trillium implements {', '.join(_KEYS)}")
    method = value.get("method")
    if method in ("[ngram]",):
        method = "ngram"
    if method in _NOT_IMPLEMENTED:
        raise ValueError(f"--speculative-config method {method!r} is not implemented; use one of {list(METHODS)}")
    if method not in METHODS:
        raise ValueError(f"--speculative-config method must be one of {list(METHODS)}, got {method!r}")
    k = _int(value, "num_speculative_tokens", None)
    if k is None:
        raise ValueError("--speculative-config needs num_speculative_tokens")
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"--speculative-config num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, got {k}")
    lo, hi = _int(value, "prompt_lookup_min", None), _int(value, "prompt_lookup_max", None)
    # vLLM's defaults (vllm/config/speculative.py): both 5 when neither is given, else the given one.
    if lo is None and hi is None:
        lo = hi = 5
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    if lo < 1 or hi < lo:
        raise ValueError(f"--speculative-config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo}, {hi}")
    return SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi)


def _int(value: dict, key: str, default):
    got = value.get(key, default)
    if got is None:
        return default
    if isinstance(got, bool) or not isinstance(got, int):
        raise ValueError(f"--speculative-config {key} must be an integer, got {got!r}")
    return got
