"""No request field is silently ignored: what a body may carry that Trillium does not act on.

A parsed body (protocol.py) keeps the fields its model does not declare
aside (pydantic's `model_extra`). `refuse_unimplemented(body)` walks the body
and its nested models (messages, stream_options) and raises a 400 naming the
first such field whose value would ask for behaviour Trillium lacks:

    value null, [] or {}              accepted: it asks for nothing
    the field's "off" value below     accepted: it asks for what Trillium does
                                      anyway (use_beam_search: false, ...)
    anything else                     400 naming the field

The "off" values are those of fields that vLLM's or OpenAI's request models
declare (vllm/entrypoints/openai/completion/protocol.py and
chat_completion/protocol.py, OpenAI's API reference), so clients that send
their defaults explicitly keep working. Informational fields (`user`,
`metadata`, `session_id`, ...) are declared on the models themselves and
listed in INFORMATIONAL_FIELDS (the README lists them too).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from trillium.data_plane.errors import bad_request

# Fields a body may carry for the client's own bookkeeping; accepted, never acted on.
INFORMATIONAL_FIELDS = ("user", "metadata", "session_id", "safety_identifier", "prompt_cache_key")

# vLLM / OpenAI fields Trillium does not implement, with the values that mean "off".
COMMON_OFF_VALUES: Mapping[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "watermarking": (False,),
    "thinking_token_budget": (-1,),
    "routed_experts_prompt_start": (0,),
    "return_token_offsets": (False,),
    "return_mm_kwargs": (True,),
    "store": (False,),
    "service_tier": ("auto", "default"),
}
CHAT_OFF_VALUES: Mapping[str, tuple[Any, ...]] = {
    **COMMON_OFF_VALUES,
    "echo": (False,),
    "return_prompt_text": (False,),
    "modalities": (["text"],),
}


def _same(value: Any, off: Any) -> bool:
    # WHY the type check: in Python True == 1 == 1.0, but `"n_best": true` is not 1.
    if isinstance(off, float) and type(value) is int:
        return value == off
    return type(value) is type(off) and value == off


def _asks_nothing(value: Any, off_values: tuple[Any, ...]) -> bool:
    if value is None or value == [] or value == {}:
        return True
    return any(_same(value, off) for off in off_values)


def refuse_unimplemented(body: BaseModel, path: str = "") -> None:
    """400 naming the first field of `body` (or of a nested model) that Trillium would ignore."""
    off_values: Mapping[str, tuple[Any, ...]] = getattr(type(body), "off_values", {})
    for name, value in (body.model_extra or {}).items():
        if _asks_nothing(value, off_values.get(name, ())):
            continue
        param = f"{path}.{name}" if path else name
        if name in off_values:
            allowed = " or ".join(json.dumps(v) for v in off_values[name])
            raise bad_request(f"{param}: is not supported (only {allowed} or null is accepted)", param)
        raise bad_request(f"{param}: unknown or unsupported field; Trillium refuses fields it "
                          "would otherwise ignore", param)
    for name in type(body).model_fields:
        value = getattr(body, name)
        child = f"{path}.{name}" if path else name
        if isinstance(value, BaseModel):
            refuse_unimplemented(value, child)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    refuse_unimplemented(item, f"{child}[{i}]")


__all__ = ["CHAT_OFF_VALUES", "COMMON_OFF_VALUES", "INFORMATIONAL_FIELDS", "refuse_unimplemented"]
