"""api -> scheduler and detokenizer -> scheduler: request lifecycle commands.

Pattern: PUSH (api, detokenizer) -> PULL (scheduler inbox, the scheduler binds).
"""

from __future__ import annotations

import attrs
import numpy as np

from trillium.sampling_params import SamplingParams


@attrs.frozen
class AddRequest:
    """A tokenized, validated request with `sampling.n` choices.

    The request crosses once, whatever n: with n > 1 the scheduler expands it
    (`choices()`) into engine requests `<request_id>-<i>` in group
    `request_id`, choice i sampling with `seed + i` (vLLM's numbering), all
    sharing this message's prompt and stop list. The scheduler admits
    siblings once the first has prefilled, so they hit its prefix blocks.
    A sender may still send one AddRequest per choice (n == 1 each) with a
    shared `group_id` (a traced request: one span carrier per choice)."""

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

    def choice_ids(self) -> tuple[str, ...]:
        """The engine request ids this message becomes."""
        if self.sampling.n == 1:
            return (self.request_id,)
        return tuple(f"{self.request_id}-{i}" for i in range(self.sampling.n))

    def choices(self) -> tuple["AddRequest", ...]:
        """One AddRequest per choice (n == 1 each); they share this one's arrays and tuples."""
        if self.sampling.n == 1:
            return (self,)
        seed = self.sampling.seed
        return tuple(
            attrs.evolve(self, request_id=rid, group_id=self.request_id,
                         sampling=attrs.evolve(self.sampling, n=1, seed=None if seed is None else seed + i))
            for i, rid in enumerate(self.choice_ids())
        )


@attrs.frozen
class AbortRequest:
    """Client gone or operator abort: free the requests' blocks this step."""

    request_ids: tuple[str, ...]


@attrs.frozen
class FinishRequest:
    """detokenizer -> scheduler: a stop string matched; stop generating."""

    request_ids: tuple[str, ...]


MESSAGES = (AddRequest, AbortRequest, FinishRequest)
