"""Drive a model through the paged path the way the executor will.

`run_schedule` feeds a list of steps, each a list of (sequence index, number
of new tokens), through `model.forward` with a shared paged KV cache, blocks
handed out from a shuffled free list, and returns each sequence's logits for
every position. Tests compare those against HF's full-sequence forward.
"""

from __future__ import annotations

import random

import torch

from trillium.kernels import AttentionMetadata

# Prefill three ragged prompts (one chunked), then a prefill-with-context chunk
# next to decodes, then pure decode steps. Totals: 9, 14 and 6 tokens.
DEFAULT_LENGTHS = (9, 14, 6)
DEFAULT_SCHEDULE = (
    ((0, 6), (1, 7), (2, 3)),
    ((0, 1), (1, 3), (2, 1)),
    ((0, 1), (1, 1), (2, 1)),
    ((0, 1), (1, 1), (2, 1)),
    ((1, 1),),
    ((1, 1),),
)


def run_schedule(
    model,
    sequences: list[list[int]],
    schedule=DEFAULT_SCHEDULE,
    block_size: int = 4,
    num_blocks: int = 32,
    seed: int = 0,
    kv_dtype: str | None = None,
) -> list[torch.Tensor]:
    """Per-sequence logits [len(seq), vocab] (float32, CPU) computed step by step.

    kv_dtype: the KV cache's ('fp8_e4m3', ...); the model's dtype when None.
    """
    rng = random.Random(seed)
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)
    kv_caches = model.allocate_kv_caches(num_blocks, block_size, kv_dtype)
    computed = [0] * len(sequences)
    tables: list[list[int]] = [[] for _ in sequences]
    outputs: list[list[torch.Tensor]] = [[] for _ in sequences]
    device = model.device
    for step in schedule:
        ids, positions, query_lens, seq_lens, step_tables = [], [], [], [], []
        for seq, num_new in step:
            start, end = computed[seq], computed[seq] + num_new
            assert end <= len(sequences[seq]), "schedule runs past the sequence"
            while len(tables[seq]) * block_size < end:
                tables[seq].append(free_blocks.pop())
            ids.extend(sequences[seq][start:end])
            positions.extend(range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            step_tables.append(list(tables[seq]))
            computed[seq] = end
        meta = AttentionMetadata.build(query_lens, seq_lens, step_tables, block_size, device=device)
        with torch.inference_mode():
            hidden = model(
                torch.tensor(ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device),
                kv_caches,
                meta,
            )
            logits = model.compute_logits(hidden)
        if logits is None:  # a tensor-parallel rank past the first: rank 0 holds the gathered logits
            continue
        logits = logits.cpu()
        for (seq, _), chunk in zip(step, logits.split(query_lens)):
            outputs[seq].append(chunk)
    assert computed == [len(s) for s in sequences], "schedule does not cover every token"
    return [torch.cat(chunks) if chunks else None for chunks in outputs]


def random_sequences(vocab_size: int, lengths=DEFAULT_LENGTHS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def load_hf(path, dtype=None):
    """transformers' model for an HF directory, in eval mode (float32 unless told)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32)
    return model.eval()


def hf_logits(hf_model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """HF full-sequence logits, one forward per sequence (float32, CPU)."""
    out = []
    with torch.inference_mode():
        for seq in sequences:
            out.append(hf_model(torch.tensor([seq])).logits[0].float().cpu())
    return out


def max_abs_diff(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(ours, ref))
