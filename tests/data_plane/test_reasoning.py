"""Reasoning parsers and a choice's reply (thinking, content, tool calls) on fixed text.

Semantics mirror vLLM's vllm/reasoning/basic_parsers.py
(`BaseThinkingReasoningParser.extract_reasoning`), deepseek_r1_reasoning_parser.py
and qwen3_reasoning_parser.py: a leading <think> is dropped, no </think>
means the reply was all thinking, an empty answer is null, qwen3 with
enable_thinking false reads no thinking, and a prompt that closed the
thinking (`prompt_is_reasoning_end`) leaves the reply all answer. Streamed
splits (character by character and in chunks) must equal the whole split.
"""

from __future__ import annotations

import json

import attrs
import pytest

from trillium.data_plane.chat_options import ChatOptions, load_chat_template
from trillium.data_plane.chat_reply import ChoiceReply, ReplyFormat, finish_reason
from trillium.data_plane.reasoning import ReasoningParser, ReasoningStream, prompt_ends_reasoning, reasoning_parser
from trillium.data_plane.tool_choice import ToolPlan
from trillium.data_plane.tool_parsers import tool_parser

SPLITS = [
    ("<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n", "\n\nHello!"),
    ("The user greets me.</think>Hello!", "The user greets me.", "Hello!"),  # <think> was in the prompt
    ("<think>Still thinking when max_tokens hit", "Still thinking when max_tokens hit", None),
    ("no markers at all", "no markers at all", None),
    ("<think>done</think>", "done", None),
    ("  <think>a</thi</think>b</think>c", "a</thi", "b</think>c"),
    ("", "", None),
]


@pytest.mark.parametrize(("text", "reasoning", "content"), SPLITS)
def test_split_whole_and_streamed(text, reasoning, content):
    parser = ReasoningParser("deepseek_r1")
    assert parser.split(text) == (reasoning, content)
    for chunk in (1, 2, 5):
        stream = ReasoningStream()
        pieces = [stream.feed(text[i:i + chunk]) for i in range(0, len(text), chunk)] + [stream.finish()]
        assert "".join(r for r, _ in pieces) == reasoning
        assert "".join(c for _, c in pieces) == (content or "")


def test_qwen3_enable_thinking_false_reads_no_thinking():
    assert reasoning_parser("qwen3", {"enable_thinking": False}) is None
    assert reasoning_parser("qwen3", None) == ReasoningParser("qwen3")
    assert reasoning_parser("deepseek_r1", {"enable_thinking": False}) == ReasoningParser("deepseek_r1")
    with pytest.raises(ValueError):
        reasoning_parser("o1", None)


def test_prompt_that_closed_the_thinking():
    # Qwen3's template with enable_thinking=false ends the prompt with an empty think block.
    assert prompt_ends_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_ends_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_ends_reasoning("<|im_start|>assistant\n")


def _decode(ids) -> str:
    return "".join(map(chr, ids))


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def _run(reply_format: ReplyFormat, text: str, chunk: int):
    """Stream `text` through a ChoiceReply (one 'token' per character) and read a whole one."""
    reply_format = attrs.evolve(reply_format, decode=_decode)
    streamed = ChoiceReply(reply_format)
    deltas = [streamed.feed(text[i:i + chunk], _ids(text[i:i + chunk])) for i in range(0, len(text), chunk)]
    deltas.append(streamed.finish())
    whole = ChoiceReply(reply_format)
    for i in range(0, len(text), chunk):
        whole.record(text[i:i + chunk], _ids(text[i:i + chunk]))
    return deltas, streamed, whole.message()


def test_thinking_then_a_tool_call():
    """Qwen3 style: thinking, then a hermes call in the answer."""
    text = ('<think>I need the weather.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>')
    fmt = ReplyFormat(ReasoningParser("qwen3"), True, True, ToolPlan([{}], tool_parser("hermes")))
    for chunk in (1, 4):
        deltas, streamed, (message, called) = _run(fmt, text, chunk)
        assert called and streamed.called_tools
        assert message["reasoning_content"] == message["reasoning"] == "I need the weather."
        assert message["content"] == "\n\n"
        (call,) = message["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "I need the weather."
        assert "".join(d.get("content", "") for d in deltas) == "\n\n"
        entries = [e for d in deltas for e in d.get("tool_calls", [])]
        assert entries[0]["function"]["name"] == "get_weather"
        assert json.loads("".join(e["function"]["arguments"] for e in entries)) == {"city": "Paris"}
        # a 'token' per character: every one through the one closing </think> (34 characters of thinking
        # and markers), also in chunks of 4, whose ninth chunk holds the end of </think> and "\n\n"
        assert streamed.reasoning_tokens == 34


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 9])
def test_reasoning_tokens_do_not_depend_on_how_tokens_are_grouped_into_deltas(chunk):
    """Tokens of several characters, </think> split over two of them (and over two deltas when chunk
    is 1 or 4): the count is every token through the one completing the marker, however the engine
    groups tokens into deltas (--stream-interval, multi-step chunks; 9: the reply in one delta)."""
    pieces = ["<think>", "I ", "need", " it", ".</", "think", ">\n", "\nHi", "!"]
    vocab = {i: p for i, p in enumerate(pieces)}
    fmt = ReplyFormat(ReasoningParser("qwen3"), True, True, ToolPlan(),
                      decode=lambda ids: "".join(vocab[i] for i in ids))
    for record in (True, False):  # a non-streamed and a streamed reply count alike
        reply = ChoiceReply(fmt)
        for start in range(0, len(pieces), chunk):
            ids = list(range(start, min(start + chunk, len(pieces))))
            text = "".join(pieces[i] for i in ids)
            reply.record(text, ids) if record else reply.feed(text, ids)
        assert reply.reasoning_tokens == 7
        assert reply.message()[0]["reasoning_content"] == "I need it."


def test_reasoning_tokens_follow_the_tokens_not_the_deltas_text():
    """A delta's text need not be its tokens' text: here "</" is held back (it could begin a stop
    string) and arrives with the next delta, whose last token has no text (an end-of-sequence token).
    The count is the tokens through the one completing </think>: 4, not the 5 of the delta's tokens."""
    pieces = ["hm", "</", "think", ">", "", "ok"]
    fmt = ReplyFormat(ReasoningParser("deepseek_r1"), True, True, ToolPlan(),
                      decode=lambda ids: "".join(pieces[i] for i in ids))
    reply = ChoiceReply(fmt)
    reply.feed("hm", [0])
    reply.feed("", [1])
    reply.feed("</think>", [2, 3, 4])
    reply.feed("ok", [5])
    assert reply.reasoning_tokens == 4
    assert reply.finish() == {} and reply.message()[0]["content"] == "ok"


def test_split_thinking_needs_a_decoder():
    with pytest.raises(ValueError, match="decode"):
        ChoiceReply(ReplyFormat(ReasoningParser("qwen3"), True, True, ToolPlan()))


def test_include_reasoning_false_and_no_parser():
    fmt = ReplyFormat(ReasoningParser("deepseek_r1"), True, False, ToolPlan())
    deltas, _, (message, called) = _run(fmt, "hmm</think>4", 1)
    assert message == {"content": "4", "reasoning_content": None, "reasoning": None} and not called
    assert not any("reasoning" in d for d in deltas)
    plain = ReplyFormat()
    _, _, (message, _) = _run(plain, "<think>x</think>4", 3)
    assert message == {"content": "<think>x</think>4"}


def test_finish_reason():
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("length", True) == "length"
    assert finish_reason("stop", False) == "stop"


def test_chat_options(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(template)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{{ 'inline' }}") == "{{ 'inline' }}"
    with pytest.raises(ValueError, match="--chat-template"):
        load_chat_template("/no/such/template.jinja")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ChatOptions.build(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ChatOptions.build(tool_call_parser="nope")
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ChatOptions.build(reasoning_parser="nope")
    options = ChatOptions.build(chat_template=str(template), enable_auto_tool_choice=True,
                                tool_call_parser="hermes", reasoning_parser="qwen3")
    assert options.chat_template == "{{ messages[0]['content'] }}" and options.tool_call_parser == "hermes"
