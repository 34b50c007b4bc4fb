"""load_tokenizer on synthetic checkpoints agrees with transformers' AutoTokenizer."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from trillium.models.synthetic import BOS_ID, END_ID, EOS_ID, build_checkpoint
from trillium.models.tokenizer import load_tokenizer

TEXTS = ["The children played in the park.", "  spaces  and\nnewlines\t", "naïve café ✓ 42", ""]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What time is it?"},
    {"role": "assistant", "content": "Half past seven."},
    {"role": "user", "content": "Thanks!"},
]


@pytest.mark.parametrize("variant,adds_bos", [("llama", True), ("qwen2", False), ("qwen3", False), ("mistral", True)])
def test_matches_transformers(checkpoint, variant, adds_bos):
    path = checkpoint(variant)
    tok = load_tokenizer(path)
    hf = AutoTokenizer.from_pretrained(str(path))
    assert tok.adds_bos is adds_bos
    assert tok.vocab_size == len(hf) == 512
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text)
        assert (ids[:1] == [BOS_ID]) is adds_bos
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    prompt = tok.apply_chat_template(MESSAGES)
    assert prompt == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|user|>Thanks!<|end|>\n<|assistant|>")
    no_gen = tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert not no_gen.endswith("<|assistant|>")
    chat_ids = tok.encode_chat(MESSAGES)
    assert chat_ids.count(BOS_ID) == (1 if adds_bos else 0)  # the template's BOS, never a second
    assert tok.eos_token_ids == (EOS_ID, END_ID)
    assert tok.bos_token_id == BOS_ID
    assert set(range(7)) <= tok.special_token_ids
    assert tok.decode(chat_ids, skip_special_tokens=True).startswith("Be brief.")
    assert tok.backend is not None and tok.backend.encode("hi there", add_special_tokens=False).ids == tok.encode(
        "hi there", add_special_tokens=False
    )


def test_padded_vocab_and_missing_template(tmp_path):
    # The corpus yields ~1000 BPE tokens; the rest is padding.
    path = build_checkpoint(tmp_path / "ckpt", "llama", vocab_size=2000)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    del tokenizer_config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    tok = load_tokenizer(path)
    assert tok.vocab_size == 2000
    assert tok.decode([1999]).startswith("<|extra_")
    assert tok.decode([1999], skip_special_tokens=True) == ""
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template(MESSAGES)
