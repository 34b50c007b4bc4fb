"""A GGUF file's tokenizer, converted once and kept on disk.

transformers builds a GGUF's tokenizer from the file's metadata in Python:
seconds for a 49k-token vocabulary (SmolLM2's, the default model), paid by
every process that loads it, and `trillium serve` loads it three times (api,
detokenizer, scheduler). `load_gguf_tokenizer(path)` converts it once and
saves the result with `save_pretrained` (tokenizer.json and
tokenizer_config.json: JSON, never pickle) under

    <cache dir>/gguf-tokenizers/<key>/

`<key>`: a hash of the file's resolved path, size and mtime and the
transformers version, so an edited file or an upgraded converter makes a new
entry. Later loads read the entry (a fraction of a second). The cache dir is
trillium/local_cache.py's.

An entry is written to a temp dir beside it and renamed into place, so a
reader never sees half of one and two processes converting at once both
succeed (the second rename loses, harmlessly). A cache that cannot be
written is logged once and skipped: the converted tokenizer is used as is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from trillium.local_cache import cache_dir

log = logging.getLogger(__name__)

_COMPLETE = "trillium-complete"  # written last: an entry without it is ignored


def entry_key(gguf_path: Path) -> str:
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    text = f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load_gguf_tokenizer(gguf_path: Path) -> PreTrainedTokenizerBase:
    """The file's tokenizer: from the cache when converted before, else converted (and cached)."""
    entry = cache_dir() / "gguf-tokenizers" / entry_key(gguf_path)
    if (entry / _COMPLETE).exists():
        try:
            return AutoTokenizer.from_pretrained(str(entry), local_files_only=True)
        except (OSError, ValueError) as exc:  # a damaged entry: convert again
            log.warning("ignoring the cached tokenizer %s: %s", entry, exc)
    hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    _save(hf, entry)
    return hf


def _save(hf: PreTrainedTokenizerBase, entry: Path) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    except OSError as exc:
        log.info("GGUF tokenizer cache not writable (%s); converting on every load", exc)
        return
    try:
        hf.save_pretrained(str(staging))
        (staging / _COMPLETE).write_text("")
        if entry.exists():  # a damaged entry (no marker), or another process's complete one
            if (entry / _COMPLETE).exists():
                return
            shutil.rmtree(entry, ignore_errors=True)
        os.rename(staging, entry)
        log.info("GGUF tokenizer converted once and cached in %s", entry)
    except OSError as exc:
        log.info("GGUF tokenizer not cached (%s)", exc)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
