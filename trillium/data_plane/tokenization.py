"""Tokenization off the trio loop: encode, chat templates, decode.

Short inputs run inline (a thread hop costs more than encoding a sentence);
long ones go to a worker thread through a bounded `CapacityLimiter`, so a
50k-character prompt never stalls the loop that streams everyone's tokens.
A text longer than the limits' `max_prompt_chars` (what max_model_len can
use; limits.py) is a 400 before any tokenizing, and so is a token list to
decode that is longer than the context. Chat-template and tokenizer errors
become 400s naming `messages`.

`token_text(id)` decodes one token for logprob entries, memoized: the same
few thousand tokens come back in every response.
"""

from __future__ import annotations

import functools
from typing import Any

import jinja2
import trio

from trillium.data_plane.errors import bad_request
from trillium.data_plane.limits import RequestLimits

# WHY 2000: encoding ~2k characters takes well under a millisecond; above
# that the loop would feel it, below it the thread hop dominates.
INLINE_MAX_CHARS = 2000
INLINE_MAX_TOKENS = 512
_TOKEN_TEXT_CACHE_SIZE = 65536
# apply_chat_template's own arguments: a client's chat_template_kwargs must not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict", "return_tensors",
     "padding", "truncation", "max_length", "tokenizer_kwargs", "chat_template", "continue_final_message"}
)


class TokenizerRunner:
    def __init__(self, tokenizer, *, max_threads: int = 2, chat_template: str | None = None,
                 limits: RequestLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self._chat_template = chat_template  # --chat-template; None: the tokenizer's own
        self.limits = limits or RequestLimits()
        self._limiter = trio.CapacityLimiter(max_threads)
        self.token_text = functools.lru_cache(maxsize=_TOKEN_TEXT_CACHE_SIZE)(self._token_text)

    async def _run(self, inline: bool, fn, *args) -> Any:
        if inline:
            return fn(*args)
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def encode(self, text: str, add_special_tokens: bool = True, *, param: str = "prompt") -> list[int]:
        self.limits.check_text(text, param)
        return await self._run(len(text) <= INLINE_MAX_CHARS, self._encode, text, add_special_tokens)

    async def encode_pair(self, text: str, text_pair: str, param: str = "text_1") -> list[int]:
        """Token ids of a text pair with the tokenizer's pair template (a cross-encoder's input)."""
        self.limits.check_num_chars(len(text) + len(text_pair), param)
        inline = len(text) + len(text_pair) <= INLINE_MAX_CHARS
        return await self._run(inline, self.tokenizer.encode_pair, text, text_pair)

    async def encode_plain(self, text: str, param: str = "bad_words") -> list[int]:
        """Token ids of `text` alone, no special tokens (a word to ban, say)."""
        return await self.encode(text, add_special_tokens=False, param=param)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def encode_chat(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        template_kwargs: dict | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of the templated conversation; 400 (param messages) if it cannot render.
        `continue_final_message`: the last message is left open for the model to continue
        (HF's apply_chat_template argument, as vLLM passes it)."""
        _, ids = await self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                        add_special_tokens=add_special_tokens, template_kwargs=template_kwargs,
                                        continue_final_message=continue_final_message)
        return ids

    async def render_chat(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        template_kwargs: dict | None = None,
        continue_final_message: bool = False,
        template_arguments: dict | None = None,
    ) -> tuple[str, list[int]]:
        """(text, token ids) of the templated conversation. `template_arguments`: the
        template's own parameters the server sets (tools, documents, chat_template);
        they win over the client's chat_template_kwargs."""
        num_chars = sum(len(str(m.get("content") or "")) for m in messages) + len(str(template_arguments or ""))
        self.limits.check_num_chars(num_chars, "messages")
        template_kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
        if continue_final_message:
            template_kwargs["continue_final_message"] = True
        template_kwargs.update(template_arguments or {})
        if self._chat_template is not None:
            template_kwargs.setdefault("chat_template", self._chat_template)
        return await self._run(
            num_chars <= INLINE_MAX_CHARS, self._encode_chat, messages,
            add_generation_prompt, add_special_tokens, template_kwargs,
        )

    def _encode_chat(self, messages, add_generation_prompt, add_special_tokens,
                     template_kwargs) -> tuple[str, list[int]]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise bad_request(f"messages: cannot apply the chat template: {exc}", "messages") from exc
        return text, self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return await self._run(
            len(token_ids) <= INLINE_MAX_TOKENS, self.tokenizer.decode, token_ids, skip_special_tokens
        )

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        """The vocabulary's strings of the ids (vLLM's `token_strs`: convert_ids_to_tokens)."""
        return await self._run(len(token_ids) <= INLINE_MAX_TOKENS, self.tokenizer.convert_ids_to_tokens,
                               list(token_ids))

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
