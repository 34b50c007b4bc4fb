"""Train a small EAGLE head on a target's own outputs (tests and the bench; no download).

    train_checkpoint(target_path, sequences, out_dir, steps=..., seed=...) -> Path
    greedy_sequences(model, prompts, max_tokens)  the target's own greedy outputs (small models)

Teacher-forced, as EAGLE trains (Li et al. 2024): for each sequence the
target's final hidden states h_t come from one prefill (a scratch paged KV
cache), and at every position t the head reads (h_t, token_{t+1}) and learns
to predict h_{t+1} (smooth L1) and token_{t+2} through the target's LM head
(cross entropy), with a little Gaussian noise on its input features (EAGLE's
feature augmentation; drafting beyond the first token feeds the head its own
outputs). `sequences` should be the target's own generations (greedy), so
the tokens to predict are the ones the target will emit. steps=0 writes the
untrained (random) head. Written in vLLM's EAGLE format (eagle_checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from trillium.kernels import AttentionMetadata
from trillium.models.kv_cache import allocate_kv_caches
from trillium.models.loader import load_model
from trillium.speculative import eagle_checkpoint
from trillium.speculative.eagle import EagleHead

_BLOCK = 16
_NOISE = 0.05  # std of the feature noise, relative to the features' RMS
_TOKEN_WEIGHT = 1.0  # cross-entropy weight beside the feature regression
_FULL_SOFTMAX_VOCAB = 4096  # above it the cross entropy runs over the data's own tokens


@torch.no_grad()
def target_hidden_states(model, token_ids: list[int]) -> torch.Tensor:
    """[T, hidden]: the target's final hidden states for one sequence (one prefill)."""
    num = len(token_ids)
    blocks = -(-num // _BLOCK)
    caches = allocate_kv_caches(model.local_config, blocks, _BLOCK, model.dtype, model.device)
    meta = AttentionMetadata.build([num], [num], [list(range(blocks))], _BLOCK, model.device)
    ids = torch.tensor(token_ids, dtype=torch.long, device=model.device)
    return model(ids, torch.arange(num, device=model.device), caches, meta).float()


@torch.no_grad()
def greedy_sequences(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation (a full prefill per token:
    for small models and short sequences; an engine's outputs serve as well)."""
    out = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(max_tokens):
            seq.append(int(model.compute_logits(target_hidden_states(model, seq)[-1:].to(model.dtype)).argmax()))
        out.append(seq)
    return out


def train_head(model, sequences: list[list[int]], *, steps: int, seed: int = 0, lr: float = 3e-3,
               num_layers: int = 1, ce_rows: int = 1024) -> EagleHead:
    """A float32 head for `model` trained `steps` full-batch Adam steps on `sequences`."""
    import attrs

    for p in model.parameters():
        p.requires_grad_(False)
    config = attrs.evolve(model.config, num_layers=num_layers)
    longest = max(len(s) for s in sequences)
    torch.manual_seed(seed)
    head = EagleHead(config, fc_bias=False, max_positions=longest + 1, dtype=torch.float32)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    if steps <= 0:
        return head.eval()
    hiddens = [target_hidden_states(model, s) for s in sequences]
    feats = torch.cat([h[:-1] for h in hiddens])  # h_t, t = 0 .. T-2
    next_ids = torch.tensor([t for s in sequences for t in s[1:]], dtype=torch.long)  # token_{t+1}
    positions = torch.tensor([p for s in sequences for p in range(len(s) - 1)], dtype=torch.long)
    segments = [(None, len(s) - 1) for s in sequences]
    # Targets at rows whose t+2 exists: h_{t+1} and token_{t+2}.
    rows = torch.tensor([r for r, (s, t) in enumerate((s, t) for s in sequences for t in range(len(s) - 1))
                         if t + 2 < len(s)], dtype=torch.long)
    feat_target = torch.cat([h[1:] for h in hiddens])[rows]
    token_target = next_ids[rows + 1]  # token_{t+2} is the next row's token_{t+1}
    embeds = model.embed(next_ids).float()
    # WHY a vocabulary subset for a large vocabulary: the LM head dominates the cost; the
    # softmax over the tokens the data emits still tells them apart (a sampled softmax).
    vocab = torch.unique(token_target) if model.config.vocab_size > _FULL_SOFTMAX_VOCAB else None
    head_weight = model.lm_head_weight.float()  # a packed (GGUF) head: its float weights
    if vocab is not None:
        head_weight = head_weight[vocab]
        token_target = torch.searchsorted(vocab, token_target)
    scale = feats.pow(2).mean().sqrt()
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    head.train()
    with torch.enable_grad():
        for _ in range(steps):
            noisy = feats + torch.randn_like(feats) * (_NOISE * scale)
            out = head(embeds, noisy, positions, segments)[rows]
            # WHY a sample of rows: the LM head of a real vocabulary dominates the cost.
            pick = torch.randperm(len(rows))[:ce_rows]
            logits = F.linear(out[pick], head_weight)
            loss = (F.smooth_l1_loss(out, feat_target)
                    + _TOKEN_WEIGHT * F.cross_entropy(logits, token_target[pick]))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return head.eval()


def train_checkpoint(target_path: str | Path, sequences: list[list[int]], out_dir: str | Path, *,
                     steps: int, seed: int = 0, lr: float = 3e-3, ce_rows: int = 1024) -> Path:
    """Train a head for the checkpoint at `target_path`; write it to `out_dir` in vLLM's format."""
    model, _ = load_model(target_path, dtype="float32", progress=False)
    head = train_head(model, sequences, steps=steps, seed=seed, lr=lr, ce_rows=ce_rows)
    config = eagle_checkpoint.head_config_dict(model.config, num_layers=head.config.num_layers)
    return eagle_checkpoint.write_checkpoint(out_dir, config, head.hf_weights())
