"""The EAGLE head the speculative bench runs: trained here, on the target's own outputs.

No EAGLE head is published for the bench's model (SmolLM2-135M-Instruct), and
nothing is downloaded, so the bench trains one (speculative/eagle_training.py)
before it measures: the plain engine generates greedy answers to prompts of
its own (TOPICS: none of them is a bench prompt), and the head learns those
for `--eagle-steps` steps (teacher forced; a few minutes of CPU at most). A
head this small and this briefly trained accepts far less than a published
one (EAGLE's are trained on ShareGPT for hours of GPU), and the bench says so.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

TOPICS = [
    "Explain why the sky is blue.", "Write a poem about the sea at night.",
    "What are good habits for learning a new language?", "Describe how a train engine works.",
    "Tell a story about a dragon who is afraid of fire.", "How do plants turn sunlight into food?",
    "Give three tips for cooking rice well.", "What makes a good team leader?",
    "Write a letter to a friend about your holiday in the mountains.", "Why do we need sleep?",
    "Explain what a computer program is to a child.", "Describe a walk through a forest in autumn.",
    "How does a refrigerator keep food cold?", "Write a short speech for a school graduation.",
    "What should someone pack for a long hike?", "Tell a story about a robot learning to paint.",
]


def train_bench_head(llm, model: str, steps: int, max_tokens: int, out_dir: str | None = None) -> tuple[str, str]:
    """(head checkpoint directory, a line saying how it was trained)."""
    from trillium import SamplingParams
    from trillium.speculative.eagle_training import train_checkpoint

    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in TOPICS]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    t1 = time.perf_counter()
    out = Path(out_dir or tempfile.mkdtemp(prefix="trillium-eagle-head-"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # WHY: as the executor's --threads 1 (OpenMP spin-waits on a shared CPU)
    try:
        train_checkpoint(model, sequences, out, steps=steps, lr=2e-3)
    finally:
        torch.set_num_threads(threads)
    t2 = time.perf_counter()
    note = (f"eagle head: 1 layer, trained {steps} steps on {sum(len(s) for s in sequences)} tokens "
            f"({len(TOPICS)} own prompts x {max_tokens} greedy tokens; generate {t1 - t0:.0f} s, train {t2 - t1:.0f} s)")
    return str(out), note
