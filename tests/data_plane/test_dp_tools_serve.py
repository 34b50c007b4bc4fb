"""Tool calling, reasoning and chat templates against a live `trillium serve`, through the OpenAI SDK.

The server runs a tiny random model with a hermes-style chat template given
by --chat-template (written below: it renders `tools`, `documents`,
`reasoning_effort`, assistant `tool_calls` and `tool` messages, and opens a
`<think>` block when chat_template_kwargs.enable_thinking is true, else
writes a closed one as Qwen3's template does), with --enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser qwen3. A random model never
calls a tool by itself, so `required` and a named function, enforced by the
grammar (vLLM's schemas, vllm/tool_parsers/utils.py), are what prove calls
end to end; parsing `auto` replies is proven on fixed text in
test_tool_parsers.py. Reasoning mirrors vllm/reasoning/qwen3_reasoning_parser.py:
a reply that never closes its thinking is all reasoning.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict

from support.serve_process import ServeProcess
from test_dp_tool_parsers_e2e import check_forced_call

TEMPLATE = """\
{%- if tools %}<|system|>Tools:{% for t in tools %} {{ t.function.name }}{{ t.function.parameters | tojson }}\
{% endfor %}<|end|>
{% endif %}
{%- if documents %}<|system|>Docs:{% for d in documents %} {{ d.title }}={{ d.text }}{% endfor %}<|end|>
{% endif %}
{%- if reasoning_effort %}<|system|>effort={{ reasoning_effort }}<|end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.reasoning_content or '' }}{{ m.content or '' }}\
{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}\
</tool_call>{% endfor %}<|end|>
{% elif m.role == 'tool' %}<|user|><tool_response id={{ m.tool_call_id }}>{{ m.content }}</tool_response><|end|>
{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking %}<think>
{% else %}<think>

</think>

{% endif %}{% endif %}"""


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Oslo", "Lima"]
    unit: Literal["celsius", "fahrenheit"]


class Time(BaseModel):
    model_config = ConfigDict(extra="forbid")
    zone: Literal["UTC", "CET"]


def _tool(name: str, model: type[BaseModel]) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                             "parameters": model.model_json_schema()}}


TOOLS = [_tool("get_weather", Weather), _tool("get_time", Time)]
ARGUMENTS = {"get_weather": Weather, "get_time": Time}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "hermes.jinja"
    template.write_text(TEMPLATE)
    proc = ServeProcess(str(checkpoint("llama", max_position_embeddings=2048)),
                        "--max-num-seqs", "8", "--kv-cache-memory", "16MiB",
                        "--chat-template", str(template), "--trust-request-chat-template",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--reasoning-parser", "qwen3", "--responses-store-size", "2").wait_healthy(timeout_s=300)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def sdk(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def _prompt_text(server, **body) -> str:
    """The prompt the template rendered (prompt_token_ids, detokenized)."""
    reply = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                       json={"model": "test-model", "max_tokens": 1, "return_token_ids": True, **body})
    assert reply.status_code == 200, reply.text
    ids = reply.json()["prompt_token_ids"]
    return httpx.post(server.base_url + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]


def _check_calls(tool_calls, names=("get_weather", "get_time")) -> list[tuple[str, BaseModel]]:
    assert tool_calls
    calls = []
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        calls.append((call.function.name, ARGUMENTS[call.function.name].model_validate_json(call.function.arguments)))
    return calls


def test_template_gets_tools_documents_and_reasoning_effort(server):
    text = _prompt_text(server, messages=MESSAGES, tools=TOOLS, tool_choice="none", reasoning_effort="low",
                        documents=[{"title": "t1", "text": "rainy"}])
    assert "Tools: get_weather" + json.dumps(Weather.model_json_schema()) in text
    assert "Docs: t1=rainy" in text and "effort=low" in text
    assert text.endswith("<|assistant|><think>\n\n</think>\n\n")  # --chat-template, enable_thinking unset


def test_request_chat_template_and_kwargs(server):
    text = _prompt_text(server, messages=MESSAGES, chat_template="Q: {{ messages[0]['content'] }} {{ extra }}",
                        chat_template_kwargs={"extra": "E!"})
    assert text == "Q: What is the weather in Paris? E!"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice(sdk, parallel):
    """vLLM's required schema: at least one call, each a tool with valid arguments."""
    for seed in range(2):
        reply = sdk.chat.completions.create(model="test-model", messages=MESSAGES, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=parallel, max_tokens=300,
                                            temperature=1.0, seed=seed)
        choice = reply.choices[0]
        calls = _check_calls(choice.message.tool_calls)
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        if not parallel:
            assert len(calls) == 1


def test_named_tool_choice_streamed_and_not(sdk):
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = sdk.chat.completions.create(model="test-model", messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                        max_tokens=100, temperature=0)
    (call,) = reply.choices[0].message.tool_calls
    _check_calls([call], names=("get_time",))
    assert reply.choices[0].finish_reason == "tool_calls"
    stream = sdk.chat.completions.create(model="test-model", messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                         max_tokens=100, temperature=0, stream=True)
    entries, finish = [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        entries.extend(delta.tool_calls or [])
        finish = chunk.choices[0].finish_reason or finish
    assert entries[0].id.startswith("call_") and entries[0].function.name == "get_time"
    assert all(e.index == 0 for e in entries) and all(e.id is None for e in entries[1:])
    assert "".join(e.function.arguments or "" for e in entries) == call.function.arguments
    assert finish == "tool_calls"


def test_required_streamed_equals_whole(sdk):
    kwargs = dict(model="test-model", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=300,
                  temperature=0)
    whole = sdk.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    for chunk in sdk.chat.completions.create(**kwargs, stream=True):
        for entry in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(entry.index, {"name": None, "arguments": ""})
            if entry.function.name:
                call["name"] = entry.function.name
            call["arguments"] += entry.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole]


def test_multi_turn_tool_conversation(sdk, server):
    """An assistant turn with tool_calls and the tool's answer go back through the template, then
    the conversation continues (a called tool, answered, then another required call)."""
    call = {"id": "call_0123456789abcdef01234567", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "hm"},
               {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees"}]
    text = _prompt_text(server, messages=history, tools=TOOLS, tool_choice="none")
    assert ('<|assistant|>hm<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
            "</tool_call>" in text)
    assert f"<tool_response id={call['id']}>18 degrees</tool_response>" in text
    plain = sdk.chat.completions.create(model="test-model", messages=history, tools=TOOLS, tool_choice="none",
                                        max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls in (None, [])
    assert isinstance(plain.choices[0].message.content, str)
    again = sdk.chat.completions.create(model="test-model", messages=history, tools=TOOLS, tool_choice="required",
                                        max_tokens=300, temperature=0)
    message = again.choices[0].message
    _check_calls(message.tool_calls)
    history += [message.model_dump(exclude_none=True), {"role": "user", "content": "thanks"}]
    last = sdk.chat.completions.create(model="test-model", messages=history, tools=TOOLS, max_tokens=4)
    assert last.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_auto_hermes_reply_is_read_into_tool_calls(sdk):
    """The reply forced into hermes' format (test_dp_tool_parsers_e2e.py) becomes a tool call."""
    check_forced_call(sdk, "hermes")


def test_auto_reply_without_calls_is_content(sdk):
    reply = sdk.chat.completions.create(model="test-model", messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                        temperature=0)
    choice = reply.choices[0]
    assert choice.message.tool_calls in (None, []) and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")


def test_reasoning_split_streamed_and_not(sdk):
    """enable_thinking opens <think> in the prompt; the reply never closes it: all thinking."""
    kwargs = dict(model="test-model", messages=MESSAGES, max_tokens=12, temperature=0,
                  extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    whole = sdk.chat.completions.create(**kwargs)
    message = whole.choices[0].message.model_dump()
    assert message["content"] is None and message["reasoning_content"] == message["reasoning"]
    assert message["reasoning"]
    details = whole.usage.completion_tokens_details
    assert details.reasoning_tokens == whole.usage.completion_tokens == 12
    reasoning, content, usage = "", "", None
    for chunk in sdk.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert reasoning == message["reasoning"] and content == ""
    assert usage.completion_tokens_details.reasoning_tokens == 12


def test_tool_grammar_waits_for_the_end_of_thinking(sdk):
    """With the thinking open, the required grammar is held back until </think> (activate_after):
    the random model never closes it, so the reply is free thinking and no call, where the same
    request without thinking is forced into calls."""
    kwargs = dict(model="test-model", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=16,
                  temperature=0)
    thinking = sdk.chat.completions.create(**kwargs, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = thinking.choices[0].message.model_dump()
    assert message["reasoning"] and not message["reasoning"].lstrip().startswith("[{")
    assert message["tool_calls"] == [] and thinking.choices[0].finish_reason == "length"
    forced = sdk.chat.completions.create(**{**kwargs, "max_tokens": 300})
    _check_calls(forced.choices[0].message.tool_calls)


def test_thinking_disabled_is_all_content(sdk):
    reply = sdk.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=6, temperature=0,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message.model_dump()
    assert message["reasoning_content"] is None and isinstance(message["content"], str) and message["content"]
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


def test_bad_tool_requests_are_400s(sdk):
    with pytest.raises(openai.BadRequestError, match="no tool named"):
        sdk.chat.completions.create(model="test-model", messages=MESSAGES, tools=TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        sdk.chat.completions.create(model="test-model", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                    response_format={"type": "json_object"})


def test_responses_api_with_the_served_flags(sdk):
    """/v1/responses on `trillium serve` (the route itself: test_dp_responses*.py on the harness): function_call
    items go through --chat-template as chat's tool_calls do (vLLM's responses/utils.py
    construct_chat_messages_with_tool_call), reasoning.effort reaches it as reasoning_effort, and
    --responses-store-size 2 keeps the last two responses only."""
    call = {"id": "call_0123456789abcdef01234567", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    items = [*MESSAGES, {"type": "function_call", "call_id": call["id"], "name": "get_weather",
                         "arguments": call["function"]["arguments"]},
             {"type": "function_call_output", "call_id": call["id"], "output": "18 degrees"}]
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    reply = sdk.responses.create(model="test-model", input=items, tools=tools, tool_choice="none",
                                 max_output_tokens=8, temperature=0, reasoning={"effort": "low"})
    chat = sdk.chat.completions.create(
        model="test-model", messages=[*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                                      {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees"}],
        tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0, reasoning_effort="low")
    assert reply.output_text == (chat.choices[0].message.content or "")
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    later = [sdk.responses.create(model="test-model", input="hi", max_output_tokens=2).id for _ in range(2)]
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(reply.id)
    assert [sdk.responses.retrieve(kept).id for kept in later] == later
