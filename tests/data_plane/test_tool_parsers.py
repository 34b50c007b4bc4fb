"""Tool-call parsers on model outputs in their documented formats, whole and streamed.

The outputs are the formats vLLM's parsers read (vllm/tool_parsers/
hermes_tool_parser.py, llama_tool_parser.py, mistral_tool_parser.py,
pythonic_tool_parser.py) and the model outputs of vLLM's own parser tests
(tests/tool_parsers/test_pythonic_tool_parser.py: Llama 3.2's documented
response format; tests/tool_parsers/test_llama3_json_tool_parser.py). Every
case runs twice: whole (`message_fields`) and streamed in chunks of 1, 3 and
7 characters (`ToolCallStream`), and both must give the same content and
calls; each streamed call starts with an entry holding its index, id, type
and name (arguments ""), as OpenAI streams them.
"""

from __future__ import annotations

import json
import re

import pytest

from trillium.data_plane.tool_parsers import TOOL_PARSERS, tool_parser
from trillium.data_plane.tool_parsers.forced import NamedToolCall, RequiredToolCalls, named_schema, required_schema
from trillium.data_plane.tool_stream import ToolCallStream, message_fields

WEATHER = ("get_weather", {"city": "San Francisco", "metric": "celsius"})
USER = ("register_user", {"name": "John Doe", "age": 37, "address": {"city": "San Francisco", "state": "CA"},
                          "role": None, "passed_test": True, "aliases": ["John", "Johnny"]})

CASES = [
    # hermes (Qwen2.5 / Qwen3 / Hermes 2 Pro): JSON between <tool_call> tags, content before them
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco", "metric": "celsius"}}\n'
               "</tool_call>", None, [WEATHER]),
    ("hermes", 'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco", '
               '"metric": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "register_user", "arguments": '
               + json.dumps(USER[1]) + "}\n</tool_call>", "Let me look that up.\n", [WEATHER, USER]),
    ("hermes", '<tool_call>{"name": "q", "arguments": {"s": "a } ] \\" <tool_call>"}}</tool_call>', None,
     [("q", {"s": 'a } ] " <tool_call>'})]),
    ("hermes", "No tools needed, the answer is 4.", "No tools needed, the answer is 4.", []),
    # llama3_json (Llama 3.1 / 3.2): bare JSON, `parameters`, `;` between calls, optional <|python_tag|>
    ("llama3_json", '{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}', None,
     [("searchTool", {"query": "test query", "limit": 10})]),
    ("llama3_json", '<|python_tag|>{"name": "searchTool", "parameters": {"query": "test1"}}; '
                    '{"name": "getOpenIncidentsTool", "parameters": {}}', None,
     [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {})]),
    ("llama3_json", '{"name": "searchTool", "arguments": {"query": "test"}}\n'
                    '{"name": "getOpenIncidentsTool", "parameters": {}}', None,
     [("searchTool", {"query": "test"}), ("getOpenIncidentsTool", {})]),
    ("llama3_json", "This is just some text without any tool calls",
     "This is just some text without any tool calls", []),
    # mistral: [TOOL_CALLS] then a JSON array (tokenizers before v11) or name[ARGS]{json} (v11+)
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "San Francisco", "metric": "celsius"}}]',
     None, [WEATHER]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, '
                '{"name": "mul", "arguments": {"a": 2, "b": 8}}]', "Sure. ",
     [("add", {"a": 3.5, "b": 4}), ("mul", {"a": 2, "b": 8})]),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 3.5, "b": 4}[TOOL_CALLS]get_weather{"city": "San Francisco", '
                '"metric": "celsius"}', None, [("add", {"a": 3.5, "b": 4}), WEATHER]),
    ("mistral", "The sum is 7.5.", "The sum is 7.5.", []),
    # pythonic (Llama 3.2 / Llama 4): a Python list of calls with literal keyword arguments
    ("pythonic", "[get_weather(city='San Francisco', metric='celsius')]", None, [WEATHER]),
    ("pythonic", "[get_weather(city='San Francisco', metric='celsius'), register_user(name='John Doe', age=37, "
                 "address={'city': 'San Francisco', 'state': 'CA'}, role=None, passed_test=True, "
                 "aliases=['John', 'Johnny'])]", None, [WEATHER, USER]),
    ("pythonic", "[get_weather()]", None, [("get_weather", {})]),
    ("pythonic", r"[get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')]", None,
     [("get_weather", {"city": "Martha's Vineyard", "metric": '"cool units"'})]),
    ("pythonic", "<|python_start|>[get_weather(city='San Francisco', metric='celsius')]<|python_end|>", None,
     [WEATHER]),
    ("pythonic", "How can I help you today?", "How can I help you today?", []),
]


def _streamed(parser, text: str, chunk: int, max_calls=None):
    stream = ToolCallStream(parser, max_calls)
    content, names, args, ids = "", {}, {}, {}
    pieces = [stream.feed(text[i:i + chunk]) for i in range(0, len(text), chunk)] + [stream.finish()]
    for piece_content, deltas in pieces:
        content += piece_content
        for delta in deltas:
            index = delta["index"]
            if "id" in delta:
                assert index not in ids and index == len(ids), "a call's first entry comes once, in order"
                assert delta["type"] == "function" and delta["function"]["arguments"] == ""
                ids[index], names[index] = delta["id"], delta["function"]["name"]
            else:
                assert index in ids and set(delta) == {"index", "function"}
            args[index] = args.get(index, "") + delta["function"]["arguments"]
    return content, [(names[i], json.loads(args[i])) for i in sorted(names)], list(ids.values())


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parser_whole_and_streamed(name, text, content, calls):
    parser = tool_parser(name)
    whole_content, tool_calls = message_fields(parser, text)
    assert whole_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls] == calls
    assert all(c["type"] == "function" for c in tool_calls)
    for chunk in (1, 3, 7):
        streamed_content, streamed_calls, ids = _streamed(parser, text, chunk)
        assert streamed_content == (content or ""), chunk
        assert streamed_calls == calls, chunk
        assert len(set(ids)) == len(ids)


# Replies that look like calls but are not: the whole reply is content (vLLM's parsers). NOTE: a
# stream has sent the call's name by the time the text goes wrong, so only whole replies are compared.
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {bad json}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}'),
    ("llama3_json", '{"name": "invalidTool", "parameters": {invalid json}'),
    ("llama3_json", '{"parameters": {}}'),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": }]'),
    ("pythonic", "[get_weather(city='Paris'), oops]"),
    ("pythonic", "[get_weather('Paris')]"),
]


@pytest.mark.parametrize(("name", "text"), MALFORMED)
def test_malformed_calls_are_content(name, text):
    assert message_fields(tool_parser(name), text) == (text, [])


def test_llama3_json_skips_text_and_json_that_are_not_calls():
    """tests/tool_parsers/test_llama3_json_tool_parser.py: surrounding prose, braces and non-call JSON."""
    text = ('Here are the results: {"name": "searchTool", "parameters": {"query": "test1"}}; '
            '{"name": "getOpenIncidentsTool", "parameters": {}} I used {searchTool}. The arguments I passed '
            'were {"query": "test"}')
    content, calls = message_fields(tool_parser("llama3_json"), text)
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["searchTool", "getOpenIncidentsTool"]


def test_call_ids():
    """OpenAI-shaped ids (`call_` + 24 hex), Mistral's 9 letters and digits."""
    for name in ("hermes", "llama3_json", "pythonic"):
        assert re.fullmatch(r"call_[0-9a-f]{24}", tool_parser(name).new_call_id())
    assert re.fullmatch(r"[A-Za-z0-9]{9}", tool_parser("mistral").new_call_id())
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json", "mistral", "pythonic"}


def test_parallel_tool_calls_false_keeps_the_first_call():
    parser = tool_parser("hermes")
    text = CASES[1][1]
    _, calls = message_fields(parser, text, max_calls=1)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    _, streamed, _ = _streamed(parser, text, 5, max_calls=1)
    assert streamed == [WEATHER]


def test_partial_tag_is_held_back_while_streaming():
    stream = ToolCallStream(tool_parser("hermes"))
    assert stream.feed("Hello <tool") == ("Hello ", [])
    assert stream.feed("ing") == ("<tooling", [])  # not a tag after all


def test_arguments_stream_in_pieces():
    """The arguments of a JSON call go out as the model writes them, not at the end."""
    stream = ToolCallStream(tool_parser("hermes"))
    stream.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "San')
    assert stream.feed(" Fran") == ("", [{"index": 0, "function": {"arguments": " Fran"}}])


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]


def test_required_schema_is_vllms():
    """vllm/tool_parsers/utils.py `_get_json_schema_from_tools`: an array of {name, parameters}."""
    schema = required_schema(TOOLS, parallel_tool_calls=True)
    assert schema == {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": TOOLS[0]["function"]["parameters"]}, "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}}}, "required": ["name", "parameters"]},
    ]}}
    assert required_schema(TOOLS, parallel_tool_calls=False)["maxItems"] == 1
    assert named_schema(TOOLS[0]) == TOOLS[0]["function"]["parameters"]


def test_required_and_named_replies():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    expected = [("get_weather", {"city": "Paris"}), ("get_time", {})]
    content, calls = message_fields(RequiredToolCalls(), text)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    assert _streamed(RequiredToolCalls(), text, 4)[1] == expected
    # a reply cut short keeps its complete calls
    _, calls = message_fields(RequiredToolCalls(), text[:70])
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    named = NamedToolCall("get_weather")
    content, calls = message_fields(named, '{"city": "Paris"}')
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert _streamed(named, '{"city": "Paris"}', 3)[1] == [("get_weather", {"city": "Paris"})]
