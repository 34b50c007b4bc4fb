"""StructuredOutputsParams and its grammar (trillium/structured_outputs.py), no engine.

Field names and the one-kind rule mirror vLLM's `StructuredOutputsParams`
(vllm/sampling_params.py); validation builds the grammar without compiling
it, as vLLM's `validate_xgrammar_grammar` does
(vllm/v1/structured_output/backend_xgrammar.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import xgrammar as xgr

from trillium.actors.assembly import engine_codec
from trillium.actors.protocol.requests import AddRequest
from trillium.sampling_params import SamplingParams
from trillium.structured_outputs import StructuredOutputsParams, build_grammar, params_from_key, \
    validate_structured_outputs


def test_exactly_one_kind():
    with pytest.raises(ValueError, match=r"exactly one of .* \(got none\)"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"\(got json, regex\)"):
        StructuredOutputsParams(json="{}", regex="a")
    with pytest.raises(ValueError, match="whitespace_pattern"):
        StructuredOutputsParams(regex="a", whitespace_pattern="")
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_dicts_become_json_text_and_the_key_ignores_activate_after():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    params = StructuredOutputsParams(json=schema, activate_after=[7, 8])
    assert json.loads(params.json) == schema and list(json.loads(params.json)["properties"]) == ["b", "a"]
    assert params.activate_after == (7, 8)
    assert params.key == StructuredOutputsParams(json=json.dumps(schema)).key
    assert params_from_key(params.key) == StructuredOutputsParams(json=schema)
    hash(SamplingParams(structured_outputs=params))  # frozen all the way down


def test_travels_through_the_codec():
    codec = engine_codec()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["x", "y z"], activate_after=[3]))
    message = AddRequest(request_id="r", prompt_token_ids=np.asarray([1, 2], np.int32), sampling=params,
                         eos_token_ids=(2,), arrival_time=0.0)
    assert codec.decode(codec.encode(message)).sampling == params


@pytest.mark.parametrize("params, words", [
    (StructuredOutputsParams(json={"type": "wat"}), "structured_outputs.json: xgrammar cannot use it: Unsupported"),
    (StructuredOutputsParams(json="{nope"), "structured_outputs.json"),
    (StructuredOutputsParams(regex="[a-"), "structured_outputs.regex: xgrammar cannot use it: Regex parsing"),
    (StructuredOutputsParams(regex="a\x00"), "structured_outputs.regex: must not contain a NUL"),
    (StructuredOutputsParams(grammar="root ::= x"), 'Rule "x" is not defined'),
    (StructuredOutputsParams(choice=()), "structured_outputs.choice: must be a non-empty list"),
    (StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}),
     "structured_outputs.structural_tag"),
    (StructuredOutputsParams(json="{}", whitespace_pattern=r"\s*"), "structured_outputs.whitespace_pattern"),
])
def test_validation_names_the_field_and_the_reason(params, words):
    with pytest.raises(ValueError) as caught:
        validate_structured_outputs(params)
    assert words in str(caught.value)
    assert "/project/cpp" not in str(caught.value)  # xgrammar's source location is stripped
    with pytest.raises(ValueError):
        SamplingParams(structured_outputs=params).validate(512)


def _accepts(grammar: xgr.Grammar, text: str) -> bool:
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar))
    return matcher.accept_string(text) and matcher.is_completed()


def test_json_layout_and_strings_are_valid_json():
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}, "n": {"type": "integer"}},
              "required": ["s", "n"]}
    spaced = build_grammar(StructuredOutputsParams(json=schema))
    compact = build_grammar(StructuredOutputsParams(json=schema, whitespace_pattern=""))
    assert _accepts(spaced, '{"s": "ab", "n": 1}') and not _accepts(spaced, '{"s":"ab","n":1}')
    assert _accepts(compact, '{"s":"ab","n":1}') and not _accepts(compact, '{"s": "ab", "n": 1}')
    assert not _accepts(spaced, '{\n"s": "ab", "n": 1}')  # no free whitespace to ramble in
    # A bounded string takes no raw control character and no surrogate (xgrammar 0.2.9 lets both in).
    for grammar in (spaced, build_grammar(StructuredOutputsParams(json={"type": "string"}))):
        text = str(grammar)
        assert "\\ud800-\\udfff" in text and "[^\\\"\\\\\\r\\n]" not in text


def test_choice_and_grammar_kinds():
    choice = build_grammar(StructuredOutputsParams(choice=('say "hi"', "a\\b")))
    assert _accepts(choice, 'say "hi"') and _accepts(choice, "a\\b") and not _accepts(choice, "say")
    assert _accepts(build_grammar(StructuredOutputsParams(json_object=True)), '{"k": [1, 2]}')
    assert not _accepts(build_grammar(StructuredOutputsParams(json_object=True)), "[1]")
