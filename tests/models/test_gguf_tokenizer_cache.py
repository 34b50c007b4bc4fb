"""The GGUF tokenizer cache's mechanics (trillium/models/gguf_tokenizer_cache.py).

That the cached tokenizer equals transformers' own conversion of the real
SmolLM2 GGUF is test_models_gguf.py's `tokenizers_pair` (it loads ours twice:
converted, then from the cache). Here, without a conversion: the key changes
with the file's mtime and size; an entry is written whole (the marker last)
and reads back as the same tokenizer; an existing complete entry is kept; an
unwritable cache dir is skipped without an error.
"""

from __future__ import annotations

import os

from transformers import AutoTokenizer

from trillium.local_cache import cache_dir
from trillium.models import gguf_tokenizer_cache as cache


def test_key_follows_the_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(16))
    key = cache.entry_key(path)
    assert cache.entry_key(path) == key
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    touched = cache.entry_key(path)
    assert touched != key
    path.write_bytes(b"GGUF" + bytes(17))
    assert cache.entry_key(path) not in (key, touched)


def test_cache_dir_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TRILLIUM_CACHE_DIR", str(tmp_path / "a"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("TRILLIUM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "trillium"


def test_entry_is_written_whole_and_reads_back(checkpoint, tmp_path):
    hf = AutoTokenizer.from_pretrained(str(checkpoint("llama")), local_files_only=True)
    entry = tmp_path / "gguf-tokenizers" / "k"
    cache._save(hf, entry)
    assert (entry / "trillium-complete").exists() and (entry / "tokenizer.json").exists()
    assert [p.name for p in entry.parent.iterdir()] == ["k"], "no staging dir is left"
    back = AutoTokenizer.from_pretrained(str(entry), local_files_only=True)
    for text in ["Once upon a time", "  spaces\nand lines", "naïve café 1234"]:
        assert back.encode(text) == hf.encode(text)
    assert back.all_special_tokens == hf.all_special_tokens and back.chat_template == hf.chat_template
    marker = (entry / "trillium-complete").stat().st_mtime_ns
    cache._save(hf, entry)  # another process's complete entry is kept
    assert (entry / "trillium-complete").stat().st_mtime_ns == marker


def test_unwritable_cache_is_skipped(checkpoint, tmp_path):
    hf = AutoTokenizer.from_pretrained(str(checkpoint("llama")), local_files_only=True)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    cache._save(hf, blocker / "gguf-tokenizers" / "k")  # logs, does not raise
    assert blocker.is_file()
