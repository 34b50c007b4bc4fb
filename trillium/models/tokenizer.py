"""Tokenizer loading: transformers' tokenizer behind a small, stable surface.

    load_tokenizer(path) -> Tokenizer

`path` is an HF model directory (tokenizer.json / tokenizer_config.json,
chat template in tokenizer_config.json or chat_template.jinja) or a `.gguf`
file (tokenizer and `tokenizer.chat_template` from its metadata; converted
once and cached on disk, gguf_tokenizer_cache.py). Loading
goes through `transformers.AutoTokenizer` with `local_files_only=True`, so
BOS handling, special tokens and chat templates are exactly HF's and no
network is touched.

NOTE on BOS: `encode(text)` adds BOS when the HF tokenizer does
(Llama-2-style). A rendered chat template usually contains the BOS text
already, so encode chat prompts with `add_special_tokens=False`, as vLLM
does (`encode_chat` does that).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from trillium.models.checkpoint_files import find_gguf_file, read_gguf_header
from trillium.models.gguf_tokenizer_cache import load_gguf_tokenizer

Message = dict[str, Any]


class Tokenizer:
    """Wraps an HF tokenizer; `backend` is the raw `tokenizers.Tokenizer` for incremental decoding."""

    def __init__(self, hf: PreTrainedTokenizerBase, extra_eos_token_ids: Sequence[int] = ()) -> None:
        self.hf = hf
        self.backend: tokenizers.Tokenizer | None = getattr(hf, "backend_tokenizer", None)
        eos = [] if hf.eos_token_id is None else [hf.eos_token_id]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *extra_eos_token_ids]))
        self.bos_token_id: int | None = hf.bos_token_id
        self.pad_token_id: int | None = hf.pad_token_id
        special = set(hf.all_special_ids)
        special |= {i for i, tok in hf.added_tokens_decoder.items() if tok.special}
        self.special_token_ids: frozenset[int] = frozenset(special)
        probe = hf.encode("a", add_special_tokens=True)
        self.adds_bos: bool = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return len(self.hf)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_pair(self, text: str, text_pair: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text pair with the tokenizer's pair template (a cross-encoder's input)."""
        return list(self.hf(text, text_pair=text_pair, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(list(token_ids)))

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template (extra kwargs go to the template)."""
        if not (self.chat_template or kwargs.get("chat_template")):
            raise ValueError("this model has no chat template; use a completion prompt instead")
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat prompt (the template supplies any BOS)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


def _json_eos_ids(path: Path) -> list[int]:
    if not path.exists():
        return []
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _gguf_eos_ids(path: Path) -> list[int]:
    metadata = read_gguf_header(path)
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return [int(metadata[k]) for k in keys if k in metadata]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Tokenizer of an HF directory or a GGUF file, read from local files only.

    eos_token_ids: the tokenizer's EOS, then config.json's and
    generation_config.json's `eos_token_id` (int or list), or for GGUF the
    metadata's eos / eot / eom ids.
    """
    gguf_path = find_gguf_file(path)
    if gguf_path is not None:
        return Tokenizer(load_gguf_tokenizer(gguf_path), _gguf_eos_ids(gguf_path))
    path = Path(path)
    hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    extra = _json_eos_ids(path / "config.json") + _json_eos_ids(path / "generation_config.json")
    return Tokenizer(hf, extra)
