"""The api's tokenizer backend, handed to the detokenizer processes as a file.

Under `trillium serve` the api process loads the HF tokenizer anyway (it
encodes prompts and renders chat templates). The detokenizer needs only that
tokenizer's backend (the raw `tokenizers.Tokenizer`: decode and the added
tokens), and loading it again through transformers would cost that process
an import of transformers and torch: seconds of a server's start on a small
machine, for nothing the detokenizer uses.

- `publish_backend(tokenizer, path)` (api): writes `tokenizer.backend`'s JSON
  (what `tokenizer.json` holds, after transformers applied its config) to
  `path`, atomically (a temporary name, then a rename), in the run's private
  0700 ipc directory (ipc_dir.py). An empty file means "no backend here,
  load the tokenizer yourself" (a slow tokenizer).
- `await receive_backend(path, tokenizer_path)` (detokenizer): waits for the
  file, then `tokenizers.Tokenizer.from_str` of it, or `load_tokenizer`
  when it is empty.

INVARIANT: the detokenizer decodes with the very backend the api encodes
with (the same serialized state, not a second load that could differ).
NOTE: a poll, not an await: the file comes from another process. It needs
no timeout: the api writes it as soon as its tokenizer is loaded, and if
that load fails the api stops every child.
"""

from __future__ import annotations

import os

import trio

BACKEND_FILE = "detokenizer-backend.json"
_POLL_S = 0.02


def publish_backend(tokenizer, path: str) -> None:
    """Write tokenizer.backend's JSON to `path` (empty when it has none), atomically."""
    backend = getattr(tokenizer, "backend", None)
    data = b"" if backend is None else backend.to_str().encode()
    temporary = f"{path}.tmp"
    with open(temporary, "wb") as f:
        f.write(data)
    os.replace(temporary, path)


async def receive_backend(path: str, tokenizer_path: str):
    """The backend the api published at `path` (waits for it); loaded here when it published none."""
    while not os.path.exists(path):
        await trio.sleep(_POLL_S)
    return await trio.to_thread.run_sync(_read, path, tokenizer_path)


def _read(path: str, tokenizer_path: str):
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        from trillium.models.tokenizer import load_tokenizer

        return load_tokenizer(tokenizer_path).backend
    import tokenizers

    return tokenizers.Tokenizer.from_str(data.decode())
