"""Each --tool-call-parser end to end: tool_choice "auto" replies read into tool calls by a live server.

A random model never writes a tool call, so the test makes it write one:
the request's own `structured_outputs.choice` forces the reply to be one
call in the parser's documented format (the formats of vLLM's parsers,
vllm/tool_parsers/hermes_tool_parser.py, llama_tool_parser.py,
mistral_tool_parser.py, pythonic_tool_parser.py), and the server must then
return it as `message.tool_calls` (finish_reason "tool_calls") and stream
it as OpenAI does, through the OpenAI SDK. hermes runs in
test_dp_tools_serve.py's `trillium serve` (the CLI flags end to end); the
other three are apps of the data-plane harness (support/data_plane_server.py
TOOL_PARSER_APPS), each with its parser's ChatOptions.
"""

from __future__ import annotations

import json

import openai
import pytest

from support.data_plane_server import MODEL_NAME, TOOL_PARSER_APPS

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
REPLIES = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "pythonic": "[get_weather(city='Paris')]",
}


def check_forced_call(client: openai.OpenAI, parser: str, model: str = "test-model") -> None:
    """The forced reply comes back as one get_weather call, whole and streamed."""
    kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=200,
                  temperature=0, extra_body={"structured_outputs": {"choice": [REPLIES[parser]]}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.id and (len(call.id) == 9 if parser == "mistral" else call.id.startswith("call_"))
    entries, content, finish = [], "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        entries.extend(delta.tool_calls or [])
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls"
    assert entries[0].function.name == "get_weather" and entries[0].id
    assert json.loads("".join(e.function.arguments or "" for e in entries)) == {"city": "Paris"}


@pytest.mark.parametrize("parser", TOOL_PARSER_APPS)
def test_parser_end_to_end(dp_server, parser):
    with openai.OpenAI(base_url=dp_server.url(f"tools-{parser}") + "/v1", api_key="unused", max_retries=0) as client:
        check_forced_call(client, parser, MODEL_NAME)
