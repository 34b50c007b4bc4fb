"""Where Trillium keeps what it builds once per machine: converted GGUF tokenizers, compiled kernels.

    cache_dir() -> $TRILLIUM_CACHE_DIR, else $XDG_CACHE_HOME/trillium, else ~/.cache/trillium

Each user keeps the entries under a subdirectory of their own
(models/gguf_tokenizer_cache.py: gguf-tokenizers/, kernels/gguf_cpu.py:
kernels/). Nothing here is downloaded; everything is derived from local
files and can be deleted at any time (it is rebuilt on the next load).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    explicit = os.environ.get("TRILLIUM_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "trillium"
