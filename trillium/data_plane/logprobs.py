"""Engine TokenLogprobs -> the two OpenAI logprob wire formats (pure functions).

Legacy completions (`logprobs: int`), parallel lists per choice:

    {"tokens": [str], "token_logprobs": [float | None],
     "top_logprobs": [{token_str: logprob} | None], "text_offset": [int]}

`top_logprobs` dicts hold the top-N plus the sampled token (as vLLM), and
`text_offset` counts characters from the start of the choice's text. With
echo, the prompt's tokens come first and the first one has no logprob.

Chat (`logprobs: true, top_logprobs: N`):

    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}

Token strings are single-token decodes (`TokenizerRunner.token_text`).
`-inf` is not JSON: logprobs are clamped at -9999.0, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from trillium.actors.protocol.execute import PromptLogprobs, TokenLogprobs

MIN_LOGPROB = -9999.0
TokenText = Callable[[int], str]


def _clamp(value: float) -> float:
    return max(value, MIN_LOGPROB)


class CompletionLogprobs:
    """Accumulates a choice's legacy logprobs; `take()` returns what was added since the last take."""

    def __init__(self, token_text: TokenText, num_top: int, text_offset: int = 0) -> None:
        self._token_text = token_text
        self._num_top = num_top
        self._offset = text_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self._taken = 0

    def _append(self, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self._offset)
        self._offset += len(token)

    def add_prompt(self, prompt_token_ids: Sequence[int], prompt_logprobs: PromptLogprobs | None) -> None:
        """Echoed prompt tokens; those before `prompt_logprobs.start` (the first) have no logprob."""
        start = prompt_logprobs.start if prompt_logprobs is not None else len(prompt_token_ids)
        entries = prompt_logprobs.entries if prompt_logprobs is not None else ()
        for position, token_id in enumerate(prompt_token_ids):
            k = position - start
            if 0 <= k < len(entries):
                self._add_entry(entries[k])
            else:
                self._append(self._token_text(token_id), None, None)

    def add(self, entries: Sequence[TokenLogprobs]) -> None:
        for entry in entries:
            self._add_entry(entry)

    def _add_entry(self, entry: TokenLogprobs) -> None:
        top: dict[str, float] = {}
        for token_id, logprob in zip(entry.top_token_ids[: self._num_top], entry.top_logprobs[: self._num_top]):
            top.setdefault(self._token_text(token_id), _clamp(logprob))
        sampled = self._token_text(entry.token_id)
        top.setdefault(sampled, _clamp(entry.logprob))
        self._append(sampled, _clamp(entry.logprob), top)

    def to_json(self, start: int = 0) -> dict:
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }

    def take(self) -> dict:
        start, self._taken = self._taken, len(self.tokens)
        return self.to_json(start)


def _chat_token(token: str, logprob: float, text: str | None = None) -> dict:
    raw = token if text is None else text
    return {"token": token, "logprob": _clamp(logprob), "bytes": list(raw.encode("utf-8"))}


def chat_logprobs(
    entries: Sequence[TokenLogprobs], token_text: TokenText, num_top: int, bytes_text: TokenText | None = None
) -> list[dict]:
    """The `content` list of chat logprobs for these sampled positions.

    `bytes_text`: where the sampled token's `bytes` come from when `token_text`
    is not its text (vLLM's return_tokens_as_token_ids keeps the decoded bytes
    there, and the placeholder's in top_logprobs)."""
    content = []
    for entry in entries:
        text = None if bytes_text is None else bytes_text(entry.token_id)
        item = _chat_token(token_text(entry.token_id), entry.logprob, text)
        item["top_logprobs"] = [
            _chat_token(token_text(token_id), logprob)
            for token_id, logprob in zip(entry.top_token_ids[:num_top], entry.top_logprobs[:num_top])
        ]
        content.append(item)
    return content
