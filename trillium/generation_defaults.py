"""Default sampling parameters from the model's generation_config.json, as vLLM applies them.

vLLM (vllm/config/model.py `ModelConfig.get_diff_sampling_param`) reads the
model's `generation_config.json` under `--generation-config auto` (its
default), a folder's under `--generation-config DIR`, nothing under `vllm`;
updates it with `--override-generation-config` (JSON) in every case; and
keeps the non-default values (transformers' `GenerationConfig.to_diff_dict`)
of six fields: repetition_penalty, temperature, top_k, top_p, min_p and
max_new_tokens (which becomes max_tokens). A request's own value wins for the
first five; max_tokens is the smallest of the request's, the default's and
what the context leaves (vllm/entrypoints/utils.py `get_max_tokens`).

    load_sampling_defaults(model_dir, generation_config, override_json) -> SamplingDefaults

`SamplingDefaults` is immutable and used by the api process (the HTTP
routes: completions, chat, SGLang's /generate) and by `trillium.LLM` when
no SamplingParams are given. Nothing here touches the engine actors.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import attrs

log = logging.getLogger(__name__)

# The request fields a default may fill, in vLLM's order; max_new_tokens -> max_tokens.
SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
_READ_FIELDS = (*SAMPLING_FIELDS, "max_new_tokens")


@attrs.frozen
class SamplingDefaults:
    """Defaults for request fields the client left unset; `source` says where they came from."""

    values: dict[str, Any] = attrs.field(factory=dict)  # SAMPLING_FIELDS names and max_tokens
    source: str = "none"

    def fill(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """`kwargs` (SamplingParams arguments) with the defaults added where absent."""
        out = dict(kwargs)
        for name in SAMPLING_FIELDS:
            if name in self.values and out.get(name) is None:
                out[name] = self.values[name]
        return out

    def max_tokens(self, requested: int | None) -> int | None:
        """vLLM: min(request's max_tokens, the default's); None when neither is set."""
        default = self.values.get("max_tokens")
        candidates = [v for v in (requested, default) if v is not None]
        return min(candidates) if candidates else None

    @property
    def default_max_tokens(self) -> int | None:
        return self.values.get("max_tokens")

    def describe(self) -> str:
        if not self.values:
            return f"no default sampling parameters ({self.source})"
        shown = ", ".join(f"{k}={v}" for k, v in self.values.items())
        return f"default sampling parameters from {self.source}: {shown} (a request's own values win)"


NO_DEFAULTS = SamplingDefaults()


def _diff_dict(folder: str) -> dict[str, Any]:
    """generation_config.json's values that differ from transformers' defaults ({} when absent)."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        raw = json.load(f)
    if not isinstance(raw, dict) or not any(name in raw for name in _READ_FIELDS):
        return {}  # WHY: no sampling field, so no need to import transformers' generation package
    try:
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(folder, local_files_only=True).to_diff_dict()
    except Exception as exc:  # WHY: a config transformers refuses still has readable numbers
        log.warning("generation_config.json in %s: transformers could not read it (%s); "
                    "using its raw values", folder, exc)
        return raw


def _checked(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _READ_FIELDS:
        value = values.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"generation config {name}: expected a number, got {value!r}")
        if name in ("top_k", "max_new_tokens"):
            value = int(value)
        out["max_tokens" if name == "max_new_tokens" else name] = value
    return out


def load_sampling_defaults(
    model_dir: str, generation_config: str = "auto", override_json: str | dict | None = None
) -> SamplingDefaults:
    """The defaults `--generation-config` / `--override-generation-config` select (see module doc)."""
    override = json.loads(override_json) if isinstance(override_json, str) and override_json else override_json
    override = override or None
    if override is not None and not isinstance(override, dict):
        raise ValueError("--override-generation-config: expected a JSON object")
    if generation_config == "vllm":
        config, source = {}, "--generation-config vllm"
    elif generation_config == "auto":
        folder = model_dir if os.path.isdir(model_dir) else os.path.dirname(model_dir)
        config, source = _diff_dict(folder), f"{os.path.join(folder, 'generation_config.json')}"
    else:
        if not os.path.isfile(os.path.join(generation_config, "generation_config.json")):
            raise ValueError(f"--generation-config {generation_config!r}: expected auto, vllm or a folder "
                             "holding generation_config.json")
        config, source = _diff_dict(generation_config), os.path.join(generation_config, "generation_config.json")
    config = {**config, **(override or {})}
    if override:
        source += " + --override-generation-config"
    return SamplingDefaults(_checked(config), source)
