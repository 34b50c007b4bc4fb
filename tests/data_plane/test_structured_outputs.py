"""Structured outputs over HTTP, every way clients send them, against a random-weight model.

A random model emits garbage, so every valid output here is the constraint's
doing. xgrammar's own GrammarMatcher is the reference: each output must be a
string its matcher accepts (and, where the grammar must end, completes).

Field names mirror the peers' own code: OpenAI's `response_format`
(openai-python src/openai/types/shared_params/response_format_json_schema.py,
and `chat.completions.parse`, src/openai/resources/chat/completions/completions.py),
vLLM's `structured_outputs` and older `guided_*` fields
(vllm/entrypoints/openai/protocol.py, vllm/sampling_params.py
`StructuredOutputsParams`), SGLang's `json_schema` / `regex` / `ebnf` /
`structural_tag` in /generate's sampling_params
(python/sglang/srt/sampling/sampling_params.py).
"""

from __future__ import annotations

import enum
import json
import re
from typing import Optional

import httpx
import openai
import pytest
import trio
import xgrammar as xgr
from pydantic import BaseModel, Field

from support.data_plane_server import MODEL_NAME
from trillium.structured_outputs import StructuredOutputsParams, build_grammar

MESSAGES = [{"role": "user", "content": "Describe a person."}]


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    name: str = Field(max_length=8)
    legs: int = Field(ge=0, le=8)


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=130)
    score: float = Field(ge=0, le=1)
    color: Color
    pets: list[Pet] = Field(max_length=2)
    nickname: Optional[str] = Field(default=None, max_length=6)


@pytest.fixture
async def sdk(dp_server):
    client = openai.AsyncOpenAI(base_url=dp_server.url() + "/v1", api_key="unused", max_retries=0)
    async with client:
        yield client


@pytest.fixture(scope="module")
def matcher_for(dp_server):
    """params -> a fresh xgrammar GrammarMatcher over the served tokenizer (the reference)."""
    tokenizer = dp_server.tokenizer
    info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, stop_token_ids=list(tokenizer.eos_token_ids))
    compiler = xgr.GrammarCompiler(info)

    def make(params: StructuredOutputsParams) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiler.compile_grammar(build_grammar(params)))

    return make


def accepted(matcher: xgr.GrammarMatcher, text: str, *, complete: bool) -> bool:
    """xgrammar's verdict on an output; `complete`: the grammar must have ended too."""
    return matcher.accept_string(text) and (not complete or matcher.is_completed())


async def test_sdk_parse_nested_pydantic_greedy_and_32_seeds(dp_server, sdk, matcher_for):
    """client.chat.completions.parse(response_format=Person): every output parses and validates."""
    reference = StructuredOutputsParams(json=openai.lib._pydantic.to_strict_json_schema(Person))
    results: dict[int | None, object] = {}

    async def one(seed: int | None) -> None:
        extra = dict(temperature=0) if seed is None else dict(temperature=1, seed=seed)
        results[seed] = await sdk.chat.completions.parse(
            model=MODEL_NAME, messages=MESSAGES, response_format=Person, max_tokens=512, **extra)

    async with trio.open_nursery() as nursery:
        for seed in [None, *range(32)]:
            nursery.start_soon(one, seed)
    texts = set()
    for seed, completion in results.items():
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", (seed, choice)
        assert isinstance(choice.message.parsed, Person)  # the SDK validated it with pydantic
        assert Person.model_validate_json(choice.message.content) == choice.message.parsed
        assert accepted(matcher_for(reference), choice.message.content, complete=True)
        texts.add(choice.message.content)
    assert len(texts) > 16  # the seeds really sample: the constraint, not greed, made them valid


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
          "maximum": 99}}, "required": ["ok", "n"]}
REGEX = r"(cat|dog)-[0-9]{2}"
CHOICES = ["alpha", "beta gamma", "delta"]
EBNF = 'root ::= "x" ("ab" | "cd"){1,3} "!"'
TAG = {"type": "structural_tag", "format": {"type": "tag", "begin": "<r>", "content": {
    "type": "json_schema", "json_schema": SCHEMA}, "end": "</r>"}}
LEGACY_TAG = {"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]}

# kind -> the engine params (the reference) and a check of the text beyond the matcher's.
KINDS = {
    "json": (StructuredOutputsParams(json=SCHEMA), lambda t: set(json.loads(t)) == {"ok", "n"}),
    "json_object": (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES),
    "grammar": (StructuredOutputsParams(grammar=EBNF), lambda t: re.fullmatch(r"x(ab|cd){1,3}!", t) is not None),
    "structural_tag": (StructuredOutputsParams(structural_tag=TAG),
                       lambda t: t.startswith("<r>") and t.endswith("</r>") and json.loads(t[3:-4])),
    "legacy_tag": (StructuredOutputsParams(structural_tag=LEGACY_TAG), lambda t: True),
}
_VLLM_FIELD = {"json": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
               "grammar": "grammar", "structural_tag": "structural_tag", "legacy_tag": "structural_tag"}
_VLLM_VALUE = {"json": SCHEMA, "json_object": True, "regex": REGEX, "choice": CHOICES, "grammar": EBNF,
               "structural_tag": TAG, "legacy_tag": LEGACY_TAG}
_GUIDED = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar",
           "legacy_tag": "structural_tag"}
_SGLANG = {"json": ("json_schema", json.dumps(SCHEMA)), "regex": ("regex", REGEX), "grammar": ("ebnf", EBNF),
           "structural_tag": ("structural_tag", json.dumps(TAG))}
_RESPONSE_FORMAT = {"json": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}},
                    "json_object": {"type": "json_object"}, "structural_tag": TAG}


def _ways():
    """(way, kind, route, extra body): each constraint kind through each way that can carry it."""
    for kind, value in _VLLM_VALUE.items():
        yield "structured_outputs", kind, "/v1/completions", {"structured_outputs": {_VLLM_FIELD[kind]: value}}
    for kind, field in _GUIDED.items():
        yield "guided", kind, "/v1/completions", {field: _VLLM_VALUE[kind]}
    for kind, (field, value) in _SGLANG.items():
        yield "sglang", kind, "/generate", {field: value}
    for kind, response_format in _RESPONSE_FORMAT.items():
        yield "response_format", kind, "/v1/chat/completions", {"response_format": response_format}
        yield "response_format", kind, "/v1/completions", {"response_format": response_format}


WAYS = list(_ways())


async def _send(client: httpx.AsyncClient, route: str, extra: dict, seed: int) -> tuple[str, str]:
    """(text, finish reason) of one request."""
    if route == "/generate":
        body = {"text": "Once upon a time", "sampling_params": {"temperature": 1.0, "max_new_tokens": 120, **extra}}
        out = (await client.post(route, json=body)).raise_for_status().json()
        return out["text"], out["meta_info"]["finish_reason"]["type"]
    body = {"model": MODEL_NAME, "max_tokens": 120, "temperature": 1.0, "seed": seed, **extra}
    if route == "/v1/chat/completions":
        body["messages"] = MESSAGES
        choice = (await client.post(route, json=body)).raise_for_status().json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    body["prompt"] = "Once upon a time"
    choice = (await client.post(route, json=body)).raise_for_status().json()["choices"][0]
    return choice["text"], choice["finish_reason"]


async def test_each_kind_through_each_way(dp_server, matcher_for):
    results: dict[int, tuple[str, str]] = {}

    async def one(i: int, route: str, extra: dict) -> None:
        results[i] = await _send(client, route, extra, seed=100 + i)

    async with httpx.AsyncClient(base_url=dp_server.url(), timeout=300) as client:
        async with trio.open_nursery() as nursery:
            for i, (_, _, route, extra) in enumerate(WAYS):
                nursery.start_soon(one, i, route, extra)
    for i, (way, kind, route, _) in enumerate(WAYS):
        text, reason = results[i]
        params, check = KINDS[kind]
        complete = kind != "legacy_tag"  # free text between tags: may run to max_tokens
        where = (way, kind, route, text, reason)
        if complete:
            assert reason == "stop", where
        assert accepted(matcher_for(params), text, complete=complete), where
        assert check(text), where
    assert {(way, kind) for way, kind, _, _ in WAYS} >= {("structured_outputs", k) for k in _VLLM_VALUE}


BAD = [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}}},
     "response_format.json_schema.schema", "wat"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "parenthesis"),
    ("/v1/completions", {"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 1}}},
     "structured_outputs.json", ""),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar",
     "missing"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ("/v1/completions", {"structured_outputs": {"whitespace_pattern": "[ ]*", "json": {}}},
     "structured_outputs.whitespace_pattern", "[ ]*"),
    ("/v1/completions", {"guided_json": {}, "guided_whitespace_pattern": "\\s+"}, "guided_whitespace_pattern", ""),
    ("/v1/completions", {"structured_outputs": {"disable_additional_properties": True, "json_object": True}},
     "structured_outputs.disable_additional_properties", ""),
    ("/v1/completions", {"structured_outputs": {"frobnicate": 1}}, "structured_outputs.frobnicate", ""),
    ("/v1/completions", {"guided_regex": "[a-"}, "guided_regex", "Unclosed"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json", ""),
    ("/v1/completions", {"guided_choice": []}, "guided_choice", ""),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "only one"),
    ("/v1/completions", {"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", ""),
    ("/v1/chat/completions", {"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "conflicts"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
]


@pytest.mark.parametrize("route, extra, param, words", BAD)
def test_bad_constraints_are_400_naming_the_field(dp_server, route, extra, param, words):
    body = {"model": MODEL_NAME, "max_tokens": 4, **extra}
    body.update({"messages": MESSAGES} if "chat" in route else {"prompt": "hi"})
    response = httpx.post(dp_server.url() + route, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"], error


@pytest.mark.parametrize("sampling, param", [
    ({"json_schema": "{\"type\": \"wat\"}"}, "sampling_params.json_schema"),
    ({"regex": "(("}, "sampling_params.regex"),
    ({"ebnf": "root ::= nope"}, "sampling_params.ebnf"),
    ({"structural_tag": "{\"structures\": 3}"}, "sampling_params.structural_tag"),
])
def test_bad_sglang_constraints_are_400(dp_server, sampling, param):
    response = httpx.post(dp_server.url() + "/generate", json={"text": "hi", "sampling_params": sampling},
                          timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
