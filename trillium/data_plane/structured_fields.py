"""Request fields that ask for structured output -> one `StructuredOutputsParams`.

Pure functions (no I/O); each raises a 400 naming the wire field. Clients
send a constraint in one of these ways, and a request may use only one:

    OpenAI   response_format {"type": "json_object"}
                             {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
                             {"type": "structural_tag", ...}   (vLLM's extension)
                             {"type": "text"} asks for nothing
             (openai-python types/shared_params/response_format_json_schema.py;
              vLLM vllm/entrypoints/openai/protocol.py `to_sampling_params`)
    vLLM     structured_outputs {json, regex, choice, grammar, json_object,
             structural_tag, whitespace_pattern} (vllm/sampling_params.py
             `StructuredOutputsParams`), and the older top-level guided_json,
             guided_regex, guided_choice, guided_grammar, structural_tag,
             guided_whitespace_pattern, guided_decoding_backend
    SGLang   sampling_params json_schema, regex, ebnf, structural_tag
             (generate_request.py; python/sglang/srt/sampling/sampling_params.py)

Each constraint's grammar is built here (xgrammar, cached by constraint), so
a schema, regex or grammar it cannot take is a 400 naming the field the
client used, with xgrammar's reason.
"""

from __future__ import annotations

import json
from typing import Any

from trillium.data_plane.errors import bad_request
from trillium.structured_outputs import StructuredOutputsParams, validate_structured_outputs

# vLLM StructuredOutputsParams options Trillium does not act on, with the values
# that ask for what it does anyway. WHY both booleans of disable_any_whitespace:
# the JSON layout is always xgrammar's fixed one; disable_fallback: there is no
# other backend to fall back to.
_VLLM_OPTIONS = {"disable_fallback": (True, False), "disable_any_whitespace": (True, False),
                 "disable_additional_properties": (False,)}
_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag", "whitespace_pattern")
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag")
_BACKENDS = ("xgrammar", "auto")


def _make(field: str, whitespace_field: str = "structured_outputs.whitespace_pattern",
          **kwargs: Any) -> StructuredOutputsParams:
    """The params, their grammar built (cached) so a bad one is a 400 naming `field`
    (or `whitespace_field` when the whitespace pattern is the problem)."""
    try:
        params = StructuredOutputsParams(**kwargs)
        validate_structured_outputs(params)
        return params
    except (ValueError, TypeError) as exc:
        head, _, why = str(exc).partition(": ")
        if head == "structured_outputs.whitespace_pattern":
            field = whitespace_field
        if not head.startswith("structured_outputs") or not why:
            why = str(exc)
        raise bad_request(f"{field}: {why}", field) from None


def from_response_format(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format (chat and completions)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _make("response_format", json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema: required, an object with name and schema",
                              "response_format.json_schema")
        schema = spec.get("schema")
        if not isinstance(schema, (dict, str)):
            raise bad_request("response_format.json_schema.schema: required, a JSON schema object",
                              "response_format.json_schema.schema")
        return _make("response_format.json_schema.schema", json=schema)
    if kind == "structural_tag":
        return _make("response_format", structural_tag=response_format)
    raise bad_request(f"response_format.type: must be one of text, json_object, json_schema, structural_tag; "
                      f"got {json.dumps(kind)}", "response_format.type")


def from_vllm_object(value: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """vLLM's `structured_outputs` object."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("structured_outputs: must be an object", "structured_outputs")
    kwargs = {}
    for name, item in value.items():
        if name in _VLLM_KINDS:
            if item is not None and item is not False:
                kwargs[name] = item
        elif name in _VLLM_OPTIONS:
            if item is not None and item not in _VLLM_OPTIONS[name]:
                raise bad_request(f"structured_outputs.{name}: is not supported (only "
                                  f"{' or '.join(json.dumps(v) for v in _VLLM_OPTIONS[name])})",
                                  f"structured_outputs.{name}")
        else:
            raise bad_request(f"structured_outputs.{name}: unknown field", f"structured_outputs.{name}")
    if not kwargs:
        return None
    kinds = [name for name in kwargs if name != "whitespace_pattern"]
    return _make(f"structured_outputs.{kinds[0]}" if len(kinds) == 1 else "structured_outputs", **kwargs)


def from_guided_fields(fields: dict[str, Any]) -> StructuredOutputsParams | None:
    """vLLM's older top-level guided_* fields (`fields`: name -> value, None = absent)."""
    backend = fields.get("guided_decoding_backend")
    if backend is not None and backend not in _BACKENDS:
        raise bad_request(f"guided_decoding_backend: only xgrammar is available, got {json.dumps(backend)}",
                          "guided_decoding_backend")
    given = {name: fields.get(name) for name in GUIDED_FIELDS if fields.get(name) is not None}
    whitespace = fields.get("guided_whitespace_pattern")
    if not given:
        if whitespace is not None:
            raise bad_request("guided_whitespace_pattern: only applies with guided_json", "guided_whitespace_pattern")
        return None
    if len(given) > 1:
        raise bad_request(f"{', '.join(given)}: only one guided decoding field may be set", next(iter(given)))
    (name, value), = given.items()
    kind = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
            "guided_grammar": "grammar", "structural_tag": "structural_tag"}[name]
    return _make(name, "guided_whitespace_pattern", **{kind: value}, whitespace_pattern=whitespace)


def from_sglang(sampling: dict[str, Any]) -> StructuredOutputsParams | None:
    """SGLang's json_schema / regex / ebnf / structural_tag in /generate's sampling_params."""
    kinds = {"json_schema": "json", "regex": "regex", "ebnf": "grammar", "structural_tag": "structural_tag"}
    given = {name: sampling.get(name) for name in kinds if sampling.get(name) is not None}
    if not given:
        return None
    if len(given) > 1:
        wire = f"sampling_params.{next(iter(given))}"
        raise bad_request(f"{wire}: only one of json_schema, regex, ebnf, structural_tag may be set", wire)
    (name, value), = given.items()
    return _make(f"sampling_params.{name}", **{kinds[name]: value})


def pick_one(sources: dict[str, StructuredOutputsParams | None]) -> StructuredOutputsParams | None:
    """The one constraint of a request; a 400 if it came in more than one way."""
    given = {name: params for name, params in sources.items() if params is not None}
    if len(given) > 1:
        names = list(given)
        raise bad_request(f"{names[1]}: conflicts with {names[0]}; send one structured-output constraint",
                          names[1])
    return next(iter(given.values()), None)


__all__ = ["GUIDED_FIELDS", "from_guided_fields", "from_response_format", "from_sglang", "from_vllm_object",
           "pick_one"]
