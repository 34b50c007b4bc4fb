"""Multi-turn chats through the offline `LLM`, for the KV tier tests.

`chat_turns` plays every conversation's turn t together, then t + 1, so
later prompts share ever longer prefixes with earlier ones (what a KV tier
keeps). Each answer is MAX_NEW greedy tokens.
"""

from __future__ import annotations

import random

from trillium import LLM, SamplingParams

MAX_NEW = 8


def chat_turns(llm: LLM, vocab: int, num_conversations: int = 4, num_turns: int = 4) -> list[tuple[list, list]]:
    """Every conversation's turn t together, then t + 1: each prompt is the
    previous prompt, its answer and 20 new tokens. Returns (prompt, output)s."""
    rng = random.Random(0)
    prompts = [[rng.randrange(7, vocab) for _ in range(40)] for _ in range(num_conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    seen = []
    for _ in range(num_turns):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for i, output in enumerate(outputs):
            tokens = output.outputs[0].token_ids
            seen.append((prompts[i], tokens))
            prompts[i] = prompts[i] + tokens + [rng.randrange(7, vocab) for _ in range(20)]
    return seen
