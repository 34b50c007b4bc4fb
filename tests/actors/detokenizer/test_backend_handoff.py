"""The api's tokenizer backend handed to the detokenizer as a file (detokenizer/backend_handoff.py).

The published backend must decode exactly as the api's own (same text, same
added tokens), for a BOS-adding and a BOS-less checkpoint; an empty file
makes the detokenizer load the tokenizer itself; a file published late is
waited for.
"""

from __future__ import annotations

import os

import pytest
import trio

from trillium.actors.detokenizer.backend_handoff import publish_backend, receive_backend
from trillium.models.tokenizer import load_tokenizer

TEXT = "Once upon a time <|eos|> there was a little robot"


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_the_published_backend_decodes_as_the_apis(checkpoint, tmp_path, variant):
    path = str(checkpoint(variant))
    tokenizer = load_tokenizer(path)
    published = str(tmp_path / "backend.json")
    publish_backend(tokenizer, published)
    assert not os.path.exists(published + ".tmp")
    backend = trio.run(receive_backend, published, path)
    ids = tokenizer.encode(TEXT) + [len(tokenizer.hf) - 1]
    for skip in (False, True):
        assert backend.decode(ids, skip_special_tokens=skip) == tokenizer.backend.decode(ids, skip_special_tokens=skip)
    assert {i: t.content for i, t in backend.get_added_tokens_decoder().items()} == {
        i: t.content for i, t in tokenizer.backend.get_added_tokens_decoder().items()}


def test_an_empty_file_means_load_it_here_and_a_late_file_is_waited_for(checkpoint, tmp_path):
    path = str(checkpoint("llama"))
    tokenizer = load_tokenizer(path)
    published = str(tmp_path / "backend.json")

    async def main():
        async with trio.open_nursery() as nursery:
            box = []

            async def receive():
                box.append(await receive_backend(published, path))

            nursery.start_soon(receive)
            await trio.sleep(0.1)
            assert not box, "no file yet: still waiting"
            (tmp_path / "backend.json").write_bytes(b"")
        return box[0]

    backend = trio.run(main)
    ids = tokenizer.encode(TEXT)
    assert backend.decode(ids) == tokenizer.backend.decode(ids)
