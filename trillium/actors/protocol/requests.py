"""api -> scheduler and detokenizer -> scheduler: request lifecycle commands.

Pattern: PUSH (api, detokenizer) -> PULL (scheduler inbox, the scheduler binds).
"""

from __future__ import annotations

import attrs
import numpy as np

from trillium.sampling_params import SamplingParams


@attrs.frozen
class AddRequest:
    """A tokenized, validated request. `n > 1` is expanded by the sender into
    one AddRequest per choice sharing `group_id` (the scheduler admits
    siblings once the first has prefilled, so they hit its prefix blocks)."""

    request_id: str
    prompt_token_ids: np.ndarray  # int32 [P]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    priority: int = 0
    group_id: str | None = None
    lora_id: int = 0
    trace_context: dict[str, str] | None = None
    # vLLM's cache_salt: mixed into the first block's prefix-cache hash, so
    # only requests with the same salt share cached blocks (None: unsalted).
    cache_salt: str | None = None


@attrs.frozen
class AbortRequest:
    """Client gone or operator abort: free the requests' blocks this step."""

    request_ids: tuple[str, ...]


@attrs.frozen
class FinishRequest:
    """detokenizer -> scheduler: a stop string matched; stop generating."""

    request_ids: tuple[str, ...]


MESSAGES = (AddRequest, AbortRequest, FinishRequest)
