"""One chat request's reply format: thinking, content and tool calls, per choice.

Built once per request in the chat route from the request, the server's
`ChatOptions` and the rendered prompt:

    reply_format(...)        -> ReplyFormat: split thinking? which tool parser?
    template_arguments(...)  -> what the chat template gets (tools, documents,
                                the template itself, reasoning_effort)
    constrain(params, ...)   -> SamplingParams with the tool grammar, and any
                                constraint held back until the thinking ends

`ChoiceReply` follows one choice's text: `feed(text, token_ids)` returns the
fields of its streamed delta (`reasoning_content` / `reasoning`, `content`,
`tool_calls`), `finish()` the last ones; a non-streamed reply `record`s each
delta and asks `message()` at the end.
`reasoning_tokens` counts the reply's tokens through the one that completes the
end-of-thinking marker (the marker's tokens included; all of them while the
thinking has not ended). A delta that is all thinking counts whole; in the
delta where the thinking ends, `ReplyFormat.decode` finds the first of its
tokens whose text (decoded after the thinking's last tokens) holds the marker,
so a delta of many tokens (--stream-interval, --num-scheduler-steps) counts the
same as one token a delta. WHY the marker's presence and not character counts:
the delta's text need not be its tokens' text (a stop string's held-back
characters, a decoder's clean-up of spaces, a character split across tokens),
but the marker is in both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs

from trillium.data_plane.chat_options import ChatOptions
from trillium.data_plane.errors import bad_request
from trillium.data_plane.reasoning import (END, START, ReasoningParser, ReasoningStream, prompt_ends_reasoning,
                                          reasoning_parser)
from trillium.data_plane.tool_choice import ToolPlan
from trillium.data_plane.tool_stream import ToolCallStream, message_fields
from trillium.sampling_params import SamplingParams
from trillium.structured_outputs import StructuredOutputsParams


@attrs.frozen
class ReplyFormat:
    reasoning: ReasoningParser | None = None  # None: no thinking is split out
    reports_reasoning: bool = False  # a --reasoning-parser is set: the message has reasoning fields
    include_reasoning: bool = True
    tools: ToolPlan = ToolPlan()
    # token ids -> their text as the request's deltas carry it (the tokenizer's decode with its
    # skip_special_tokens); needed where thinking is split out (`reasoning` set), to count its tokens
    decode: Callable[[Sequence[int]], str] | None = None

    @property
    def has_tools(self) -> bool:
        return self.tools.tools is not None


def template_arguments(req, options: ChatOptions, tools: ToolPlan) -> dict[str, Any]:
    """Keyword arguments for the chat template beyond the messages (HF apply_chat_template's names)."""
    args: dict[str, Any] = {}
    if req.chat_template is not None:
        if not options.trust_request_chat_template:
            raise bad_request("chat_template: a request's own chat template needs the server flag "
                              "--trust-request-chat-template", "chat_template")
        args["chat_template"] = req.chat_template
    if tools.tools is not None:
        args["tools"] = tools.tools
    documents = getattr(req, "documents", None)  # not on /tokenize
    if documents is not None:
        args["documents"] = documents
    return args


def template_kwargs(req) -> dict[str, Any] | None:
    """chat_template_kwargs, with `reasoning_effort` added as vLLM passes it to the template."""
    if req.reasoning_effort is None:
        return req.chat_template_kwargs
    return {"reasoning_effort": req.reasoning_effort, **(req.chat_template_kwargs or {})}


def reply_format(req, options: ChatOptions, tools: ToolPlan, prompt_text: str) -> ReplyFormat:
    parser = None
    if options.reasoning_parser is not None and not prompt_ends_reasoning(prompt_text):
        parser = reasoning_parser(options.reasoning_parser, req.chat_template_kwargs)
    return ReplyFormat(parser, options.reasoning_parser is not None, req.include_reasoning is not False, tools)


async def constrain(params: SamplingParams, reply: ReplyFormat,
                    encode: Callable[[str], Awaitable[list[int]]]) -> SamplingParams:
    """The tool grammar (required / named) on `params`; any constraint waits for the end of thinking;
    a thinking budget gets the parser's delimiters as tokens."""
    changes: dict[str, Any] = {}
    if params.thinking_token_budget is not None:
        if not reply.reports_reasoning:
            raise bad_request("thinking_token_budget: needs a reasoning model served with --reasoning-parser "
                              "(the server must know where the thinking ends)", "thinking_token_budget")
        changes["think_start_token_ids"] = tuple(await encode(START))
        changes["think_end_token_ids"] = tuple(await encode(END))
    if reply.tools.parser is not None and reply.tools.parser.keeps_special_tokens:
        changes["skip_special_tokens"] = False
    constraint = params.structured_outputs
    if reply.tools.schema is not None:
        if constraint is not None:
            raise bad_request("tool_choice: a required or named tool choice cannot be combined with "
                              "response_format or structured_outputs", "tool_choice")
        constraint = StructuredOutputsParams(json=reply.tools.schema)
    if constraint is not None and reply.reasoning is not None:
        constraint = attrs.evolve(constraint, activate_after=tuple(await encode(END)))
    if constraint is not params.structured_outputs:
        changes["structured_outputs"] = constraint
    return attrs.evolve(params, **changes) if changes else params


# Token ids of the thinking kept from before a delta: enough for a marker begun there (a token at least a
# character each).
DECODE_CONTEXT = len(END)


class ChoiceReply:
    def __init__(self, reply: ReplyFormat) -> None:
        if reply.reasoning is not None and reply.decode is None:
            raise ValueError("ReplyFormat.decode is needed to count the tokens of split-out thinking")
        self._format = reply
        self._reasoning = ReasoningStream() if reply.reasoning is not None else None
        parser = reply.tools.parser
        self._tools = ToolCallStream(parser, reply.tools.max_calls) if parser is not None else None
        self._texts: list[str] = []
        self._context: list[int] = []  # the thinking's last DECODE_CONTEXT token ids
        self.reasoning_tokens = 0

    @property
    def called_tools(self) -> bool:
        return self._tools is not None and self._tools.num_calls > 0

    def feed(self, text: str, token_ids: Sequence[int]) -> dict[str, Any]:
        """A streamed delta's fields."""
        reasoning, content = self.record(text, token_ids)
        return self._fields(reasoning, content, final=False)

    def record(self, text: str, token_ids: Sequence[int]) -> tuple[str, str]:
        """Take a delta (its text is all a non-streamed reply needs); its (reasoning, content) pieces."""
        self._texts.append(text)
        if self._reasoning is None or self._reasoning.ended:
            return "", text
        reasoning, content = self._reasoning.feed(text)
        if self._reasoning.ended:  # the thinking ends in this delta
            self.reasoning_tokens += self._tokens_through_end(token_ids)
        else:
            self.reasoning_tokens += len(token_ids)
            self._context = (self._context + list(token_ids))[-DECODE_CONTEXT:]
        return reasoning, content

    def _tokens_through_end(self, token_ids: Sequence[int]) -> int:
        """The fewest of a delta's tokens whose text, decoded after the thinking's last tokens, holds the
        end-of-thinking marker (all of them if none does; 0 for no tokens). A binary search: a delta can
        hold up to --stream-interval's 1024 tokens, or a multi-step chunk."""
        decode, context = self._format.decode, self._context
        low, high = 1, len(token_ids)
        while low < high:
            mid = (low + high) // 2
            if END in decode(context + list(token_ids[:mid])):
                high = mid
            else:
                low = mid + 1
        return high

    def feed_last(self, text: str, token_ids: Sequence[int], finished: bool) -> dict[str, Any]:
        """`feed`, followed on a choice's last delta by `finish`'s fields (text joined, tool
        call entries appended): what one streamed chunk carries."""
        fields = self.feed(text, token_ids)
        if not finished:
            return fields
        for key, value in self.finish().items():
            fields[key] = fields[key] + value if key in fields else value
        return fields

    def finish(self) -> dict[str, Any]:
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        return self._fields(reasoning, content, final=True)

    def _fields(self, reasoning: str, content: str, final: bool) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if reasoning and self._format.include_reasoning:
            fields["reasoning_content"] = fields["reasoning"] = reasoning
        calls: list[dict] = []
        if self._tools is not None:
            content, calls = self._tools.feed(content) if content else ("", [])
            if final:
                more, last = self._tools.finish()
                content, calls = content + more, calls + last
        if content:
            fields["content"] = content
        if calls:
            fields["tool_calls"] = calls
        return fields

    def message(self) -> tuple[dict[str, Any], bool]:
        """The non-streamed message's fields (role aside), and whether it calls tools."""
        text = "".join(self._texts)
        reasoning, content = (None, text) if self._format.reasoning is None else self._format.reasoning.split(text)
        message: dict[str, Any] = {}
        tool_calls: list[dict] = []
        if self._format.tools.parser is not None and content is not None:
            content, tool_calls = message_fields(self._format.tools.parser, content or "", self._format.tools.max_calls)
        message["content"] = content
        if self._format.reports_reasoning:
            shown = reasoning if self._format.include_reasoning else None
            message["reasoning_content"] = message["reasoning"] = shown
        if self._format.has_tools:
            message["tool_calls"] = tool_calls
        return message, bool(tool_calls)


def finish_reason(reason: str | None, called_tools: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended on its own with tool calls."""
    return "tool_calls" if called_tools and reason == "stop" else reason


__all__ = ["ChoiceReply", "ReplyFormat", "constrain", "finish_reason", "reply_format", "template_arguments",
           "template_kwargs"]
