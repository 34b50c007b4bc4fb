"""Reasoning parsers: a reply's thinking (`<think>...</think>`) apart from its answer.

Chosen at start-up with vLLM's `--reasoning-parser NAME`. The thinking goes
to `message.reasoning_content` (and vLLM's newer `reasoning`), the rest to
`content` (where a tool parser may read it). Semantics of vLLM's parsers
(vllm/reasoning/basic_parsers.py `BaseThinkingReasoningParser`,
deepseek_r1_reasoning_parser.py, qwen3_reasoning_parser.py):

- a leading `<think>` is dropped (templates usually put it in the prompt);
- text up to `</think>` is thinking, after it the answer (null if empty);
- no `</think>`: all of it is thinking (cut short);
- qwen3 with the request's `chat_template_kwargs.enable_thinking` false:
  no thinking is read at all, the whole reply is the answer (vLLM: all
  content when no `</think>`; Trillium does not split even if one appears,
  so a streamed and a whole reply agree);
- a prompt that already closed the thinking (`</think>` after its last
  `<think>`, as Qwen3's template writes with enable_thinking false) makes the
  whole reply the answer (vLLM's `prompt_is_reasoning_end`).

`ReasoningStream` does the same split on a growing text, holding back a
suffix that may be the start of `</think>` (NOTE: it drops a `<think>` only
at the start of the reply; the whole-reply split drops text before one
anywhere, as vLLM's does).
"""

from __future__ import annotations

import attrs

from trillium.data_plane.tool_parsers.json_text import partial_tag_overlap

START = "<think>"
END = "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@attrs.frozen
class ReasoningParser:
    name: str

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply."""
        before, found, after = text.partition(START)
        text = after if found else before
        if END not in text:
            return text, None
        reasoning, _, content = text.partition(END)
        return reasoning, content or None


def reasoning_parser(name: str, template_kwargs: dict | None) -> ReasoningParser | None:
    """The parser for one request; None when it asked qwen3 not to think."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}")
    if name == "qwen3" and (template_kwargs or {}).get("enable_thinking", True) is False:
        return None
    return ReasoningParser(name)


def prompt_ends_reasoning(prompt_text: str) -> bool:
    """The prompt closed the thinking itself: the reply is all answer."""
    return prompt_text.rfind(END) > prompt_text.rfind(START)


class ReasoningStream:
    """The split of a reply as it grows: `feed(delta) -> (reasoning, content)` pieces."""

    def __init__(self) -> None:
        self._text = ""
        self._start: int | None = None  # where thinking begins, once known
        self._sent = 0  # of the text, as reasoning or dropped markers
        self.ended = False

    def feed(self, delta: str) -> tuple[str, str]:
        self._text += delta
        if self.ended:
            return "", delta
        text = self._text
        if self._start is None and not self._locate_start(final=False):
            return "", ""  # may still become <think>
        end = text.find(END, self._start)
        if end >= 0:
            self.ended = True
            reasoning, self._sent = text[self._sent:end], end + len(END)
            return reasoning, text[self._sent:]
        hold = partial_tag_overlap(text, END)
        upto = max(self._sent, len(text) - hold)
        reasoning, self._sent = text[self._sent:upto], upto
        return reasoning, ""

    def _locate_start(self, final: bool) -> bool:
        """Find where thinking begins (after a leading <think>); False while that is unknown."""
        head = self._text.lstrip()
        if START.startswith(head) and not (final or head == START):
            return False
        offset = len(self._text) - len(head)
        self._start = self._sent = offset + len(START) if head.startswith(START) else 0
        return True

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply is complete."""
        if self.ended:
            return "", ""
        if self._start is None:
            self._locate_start(final=True)
        rest = self._text[self._sent:]
        self._sent = len(self._text)
        return rest, ""


__all__ = ["END", "REASONING_PARSERS", "START", "ReasoningParser", "ReasoningStream", "prompt_ends_reasoning",
           "reasoning_parser"]
