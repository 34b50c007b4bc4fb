"""Pooling model classes against transformers, one full-prompt forward each.

LlamaForPooling (trillium/models/pooling_model.py) is the decoder with a
`score` head (transformers' *ForSequenceClassification: a bias-free linear
on the last non-pad token's hidden state) or none (transformers' bare
*Model, or a causal LM read as its backbone, vLLM's `--convert embed`:
vllm/model_executor/models/adapters.py). Float32, within 1e-4.
"""

from __future__ import annotations

import numpy as np
import torch

from trillium.kernels import AttentionMetadata
from trillium.models.loader import load_model
from trillium.models.pooling_model import LlamaForPooling

TOL = 1e-4
IDS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 45, 8]


@torch.inference_mode()
def _pooled(model, ids: list[int], last_only: bool, block_size: int = 4) -> np.ndarray:
    """pool_head of the final hidden states of one full-prompt forward (the last row, or all)."""
    num_blocks = -(-len(ids) // block_size)
    caches = model.allocate_kv_caches(num_blocks, block_size)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(num_blocks))], block_size, device="cpu")
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), caches, meta)
    return model.pool_head(hidden[-1:] if last_only else hidden).numpy()


def test_mistral_classifier_score_head_matches_transformers(checkpoint):
    from transformers import AutoModelForSequenceClassification

    path = checkpoint("mistral-classify")
    model, config = load_model(path, progress=False)
    assert isinstance(model, LlamaForPooling) and model.output_size == config.num_labels == 2
    ours = _pooled(model, IDS, last_only=True)[0]
    hf = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([IDS])).logits[0].numpy()
    np.testing.assert_allclose(ours, expected, atol=TOL)


def test_causal_lm_read_as_embedding_backbone(checkpoint):
    """--convert embed on a Qwen3ForCausalLM checkpoint: its lm_head is skipped, the backbone is HF's Qwen3Model."""
    from transformers import AutoModel

    path = checkpoint("qwen3")
    model, _ = load_model(path, runner="pooling", progress=False)
    assert model.lm_head is None and model.score is None
    ours = _pooled(model, IDS, last_only=False)
    hf = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([IDS])).last_hidden_state[0].numpy()
    np.testing.assert_allclose(ours, expected, atol=TOL)


def test_bare_backbone_names_load_with_the_model_prefix(checkpoint):
    from safetensors import safe_open

    path = checkpoint("qwen3-embed")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "norm.weight" in names and not any(n.startswith("model.") for n in names)
    model, _ = load_model(path, progress=False)
    assert set(model.checkpoint_weight_names()) == {"model." + n for n in names}
