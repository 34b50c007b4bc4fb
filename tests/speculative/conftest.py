"""Fixtures of the speculative tests that several files share."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="session")
def draft_pair(checkpoint, tmp_path_factory):
    """(target dir, draft dir): the draft is the target's architecture with its weights perturbed,
    so it drafts well but not perfectly, and the target's own checkpoint is a valid draft update."""
    target = checkpoint("llama")
    draft = tmp_path_factory.mktemp("draft-perturbed")
    for f in target.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, draft / f.name)
    gen = torch.Generator().manual_seed(0)
    weights = load_file(target / "model.safetensors")
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=gen) if "layers" in k else v
               for k, v in weights.items()}, draft / "model.safetensors")
    return str(target), str(draft)


@pytest.fixture(scope="session")
def first_layer_draft(checkpoint, tmp_path_factory):
    """(target dir, draft dir): the draft is the target's first layer, embedding, norm and head."""
    target = checkpoint("llama")
    draft = tmp_path_factory.mktemp("draft-model")
    for f in target.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, draft / f.name)
    config = json.loads((target / "config.json").read_text())
    weights = load_file(target / "model.safetensors")
    keep = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    save_file(keep, draft / "model.safetensors")
    (draft / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    return str(target), str(draft)
