"""The server's chat settings: template, tool-call parser, reasoning parser (vLLM's flags).

    --chat-template FILE_OR_STRING     replaces the tokenizer's template
    --trust-request-chat-template      lets a request send its own `chat_template`
    --enable-auto-tool-choice          tool_choice "auto" (needs --tool-call-parser)
    --tool-call-parser NAME            hermes, llama3_json, mistral, pythonic
    --reasoning-parser NAME            deepseek_r1, qwen3

`ChatOptions.build` checks the combination once at start-up (ValueError
naming the flag); the routes only read the result.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from trillium.data_plane.reasoning import REASONING_PARSERS
from trillium.data_plane.tool_parsers import TOOL_PARSERS

# WHY these characters: vLLM's load_chat_template reads a value that is not a file
# as the template itself only when it looks like Jinja (vllm/entrypoints/chat_utils.py).
_JINJA_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """The template text of --chat-template: a file's contents, or the value itself."""
    try:
        return Path(value).read_text()
    except OSError as exc:
        if any(c in value for c in _JINJA_CHARS):
            return value
        raise ValueError(f"--chat-template: {value!r} is neither a readable file nor a Jinja template "
                         f"({exc.strerror})") from None


@attrs.frozen
class ChatOptions:
    chat_template: str | None = None  # the template text; None: the tokenizer's
    trust_request_chat_template: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    @classmethod
    def build(cls, *, chat_template: str | None = None, trust_request_chat_template: bool = False,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None) -> "ChatOptions":
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser: unknown parser {tool_call_parser!r} "
                             f"(one of {', '.join(TOOL_PARSERS)})")
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser: unknown parser {reasoning_parser!r} "
                             f"(one of {', '.join(REASONING_PARSERS)})")
        template = None if chat_template is None else load_chat_template(chat_template)
        return cls(template, trust_request_chat_template, enable_auto_tool_choice, tool_call_parser,
                   reasoning_parser)


__all__ = ["ChatOptions", "load_chat_template"]
