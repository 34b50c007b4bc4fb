"""Fixtures of the speculative tests that several files share."""

from __future__ import annotations

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
