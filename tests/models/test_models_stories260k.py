"""stories260K (a real trained 260K-param Llama 2) matches transformers and tells its story."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.paged_runner import hf_logits, load_hf, max_abs_diff, run_schedule
from trillium.kernels import AttentionMetadata
from trillium.models import load_model

STORIES = Path("/work/shared/models/stories260K/hf")
pytestmark = pytest.mark.skipif(not (STORIES / "config.json").exists(), reason=f"{STORIES} is missing")


@pytest.fixture(scope="module")
def stories():
    from trillium.models.tokenizer import load_tokenizer

    model, config = load_model(STORIES, progress=False)
    return model, config, load_tokenizer(STORIES)


def test_logits_match_transformers(stories):
    model, config, tok = stories
    assert config.tie_word_embeddings and config.head_dim == 8 and config.eos_token_ids == (2, 1)
    sequences = [tok.encode("Once upon a time, there was a"), tok.encode("Lily and Ben went to the park")]
    assert all(s[0] == 1 for s in sequences)  # Llama-2 style: BOS added, as HF does
    lens = [len(s) for s in sequences]
    schedule = (((0, lens[0] - 3), (1, 4)), ((0, 1), (1, lens[1] - 5)), ((0, 1), (1, 1)), ((0, 1),))
    ours = run_schedule(model, sequences, schedule=schedule, block_size=4, num_blocks=32)
    assert max_abs_diff(ours, hf_logits(load_hf(STORIES), sequences)) < 1e-4


def test_greedy_story_from_bos(stories):
    """Token-by-token greedy decode through the paged cache gives the documented story."""
    model, config, tok = stories
    block_size, num_blocks = 8, 8
    kv_caches = model.allocate_kv_caches(num_blocks, block_size)
    table = list(range(num_blocks))[::-1]
    tokens = [tok.bos_token_id]
    with torch.inference_mode():
        for pos in range(40):
            meta = AttentionMetadata.build([1], [pos + 1], [table], block_size)
            hidden = model(torch.tensor(tokens[-1:]), torch.tensor([pos]), kv_caches, meta)
            tokens.append(int(model.compute_logits(hidden)[0].argmax()))
    text = tok.decode(tokens, skip_special_tokens=True)
    assert text.startswith("Once upon a time, there was a little girl named Lily. She loved to play outside")
