"""The scheduler's own check of an AddRequest, before it is queued.

WHY again, after the api validated it (validation.py): the scheduler is the
one that allocates blocks and hands token ids to the embedding lookup, and
it must not depend on every sender being right. A bad request raises
ValueError here; the core turns that into an "abort" output for that
request alone (`Scheduler.reject`), and the engine carries on.

Checked: the prompt is a non-empty 1-D integer array of token ids in
[0, vocab_size); prompt + max_tokens fit max_model_len; eos ids are in the
vocabulary; the sampling parameters pass SamplingParams.validate. Cheap:
vectorised over the prompt, no per-token Python.
"""

from __future__ import annotations

import numpy as np

from trillium.actors.protocol.requests import AddRequest


def check_add_request(msg: AddRequest, *, max_model_len: int, vocab_size: int | None) -> None:
    """Raise ValueError naming what is wrong. `vocab_size` None: a core built
    without a checkpoint (unit tests); token id ranges are then not checked."""
    prompt = msg.prompt_token_ids
    if not isinstance(prompt, np.ndarray) or prompt.ndim != 1 or prompt.dtype.kind not in "iu":
        raise ValueError("prompt_token_ids: must be a 1-D integer array")
    if prompt.size == 0:
        raise ValueError("prompt_token_ids: must not be empty")
    if prompt.size >= max_model_len:
        raise ValueError(f"prompt: {prompt.size} tokens do not fit max_model_len {max_model_len}")
    if vocab_size is not None:
        if int(prompt.min()) < 0 or int(prompt.max()) >= vocab_size:
            raise ValueError(f"prompt_token_ids: token ids must be in [0, {vocab_size})")
        if any(not 0 <= t < vocab_size for t in msg.eos_token_ids):
            raise ValueError(f"eos_token_ids: must be in [0, {vocab_size})")
    params = msg.sampling
    params.validate(vocab_size)  # n >= 1 included: n > 1 is expanded by Scheduler.add_request
    if params.max_tokens is not None and prompt.size + params.max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens: prompt ({prompt.size}) + max_tokens ({params.max_tokens}) exceeds max_model_len "
            f"{max_model_len}"
        )
    if msg.lora_id < 0:
        raise ValueError(f"lora_id: must be >= 0, got {msg.lora_id}")
