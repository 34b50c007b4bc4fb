"""vLLM's rollout fields on /v1/completions and /v1/chat/completions (pure helpers).

What RL frameworks read back from, and send to, vLLM's OpenAI server,
mirroring vllm/entrypoints/openai/completion/serving.py,
chat_completion/serving.py and vllm/sampling_params.py:

    request ids      `X-Request-Id` header, else the body's `request_id`, else a
                     random hex: the response id is "<cmpl|chatcmpl>-<that>"
                     and the response's X-Request-Id header echoes it
    truncation       truncate_prompt_tokens N keeps the last N prompt tokens
                     (truncation_side "right": the first N); -1: the context
    bad_words        each word tokenized as vLLM does (as given and with a
                     leading space), the sequences banned in the sampler
    token strings    return_tokens_as_token_ids: "token_id:N" in logprobs
    prompt_logprobs  [null, {id: {logprob, rank, decoded_token}}, ...], one
                     entry per prompt token

No I/O but the tokenizer calls the caller hands in.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence

from trillium.actors.protocol.execute import PromptLogprobs, TokenLogprobs
from trillium.data_plane.errors import bad_request
from trillium.data_plane.logprobs import MIN_LOGPROB, TokenText

REQUEST_ID_HEADER = "X-Request-Id"
# vLLM's VLLM_MAX_NUM_BAD_WORDS default: token sequences per request after tokenization.
MAX_NUM_BAD_WORDS = 128


class RequestIds:
    """The ids of one HTTP request: what the client sees and what the engine uses.

    `base` is the client's id (header first, then body, as vLLM's
    `_base_request_id`) or a fresh one; `response_id` is what the body
    reports. `engine_id` is unique even when clients reuse ids, since two
    engine requests in flight can never share one."""

    def __init__(self, prefix: str, headers: Mapping[str, str], body_request_id: str | None) -> None:
        client_id = headers.get(REQUEST_ID_HEADER) or body_request_id
        self.base = client_id or uuid.uuid4().hex
        self.response_id = f"{prefix}-{self.base}"
        self.engine_id = self.response_id if client_id is None else f"{self.response_id}-{uuid.uuid4().hex[:12]}"


def truncate_prompt(
    token_ids: list[int], truncate_prompt_tokens: int | None, side: str | None, max_model_len: int
) -> list[int]:
    """The prompt after vLLM's truncate_prompt_tokens (keep the last N; -1 = the context)."""
    if truncate_prompt_tokens is None:
        return token_ids
    limit = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if limit > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens: {limit} is greater than the model's context of {max_model_len}",
            "truncate_prompt_tokens",
        )
    if len(token_ids) <= limit:
        return token_ids
    return token_ids[:limit] if side == "right" else token_ids[len(token_ids) - limit:]


async def bad_words_token_ids(
    words: Sequence[str] | None, encode: Callable[[str], Awaitable[list[int]]]
) -> tuple[tuple[int, ...], ...]:
    """vLLM's SamplingParams.update_from_tokenizer: each word as given (left-stripped)
    and, where that is a different word of as many tokens, with a leading space."""
    sequences: list[tuple[int, ...]] = []
    for word in dict.fromkeys(words or ()):
        if not word:
            raise bad_request("bad_words: cannot contain an empty string", "bad_words")
        plain = await encode(word.lstrip())
        if not plain:
            raise bad_request(f"bad_words: {word!r} does not tokenize to any token", "bad_words")
        sequences.append(tuple(plain))
        spaced = await encode(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(tuple(spaced))
    if len(sequences) > MAX_NUM_BAD_WORDS:
        raise bad_request(f"bad_words: {len(sequences)} token sequences after tokenization, "
                          f"at most {MAX_NUM_BAD_WORDS}", "bad_words")
    return tuple(sequences)


def token_id_text(token_id: int) -> str:
    """vLLM's format_token_id_placeholder."""
    return f"token_id:{token_id}"


def logprob_token_text(token_text: TokenText, as_token_ids: bool | None) -> TokenText:
    """The token strings of logprob entries: decoded text, or "token_id:N"."""
    return token_id_text if as_token_ids else token_text


def _entry_json(entry: TokenLogprobs, num_top: int, token_text: TokenText) -> dict:
    # The prompt's own token first, then the top ones (ranks 1..num_top), as vLLM's dicts.
    out = {entry.token_id: {"logprob": max(entry.logprob, MIN_LOGPROB), "rank": entry.rank,
                            "decoded_token": token_text(entry.token_id)}}
    for rank, (token_id, logprob) in enumerate(zip(entry.top_token_ids[:num_top], entry.top_logprobs), 1):
        out.setdefault(token_id, {"logprob": max(logprob, MIN_LOGPROB), "rank": rank,
                                  "decoded_token": token_text(token_id)})
    return out


def prompt_logprobs_json(
    prompt_token_ids: Sequence[int], logprobs: PromptLogprobs | None, num_top: int, token_text: TokenText
) -> list[dict | None]:
    """One entry per prompt token: null where there is none (the first token)."""
    out: list[dict | None] = [None] * len(prompt_token_ids)
    if logprobs is not None:
        for k, entry in enumerate(logprobs.entries):
            position = logprobs.start + k
            if 0 <= position < len(out):
                out[position] = _entry_json(entry, num_top, token_text)
    return out


__all__ = [
    "MAX_NUM_BAD_WORDS",
    "REQUEST_ID_HEADER",
    "RequestIds",
    "bad_words_token_ids",
    "logprob_token_text",
    "prompt_logprobs_json",
    "token_id_text",
    "truncate_prompt",
]
