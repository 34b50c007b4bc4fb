"""Request and step events for the metrics, gathered in the scheduler core.

The scheduler sees every request from arrival to finish and every step, so
the engine-side numbers (vLLM's set: TTFT, inter-token latency, queue /
prefill / decode / e2e time, token counts, step sizes) are measured here
and shipped to the api with the next `SchedulerStats`, which drains them
(`take`). Timestamps are wall clock (`time.time`): the arrival time comes
from the api process on the same host.

Pure and synchronous like the core; the clock is injectable for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from trillium.actors.protocol.outputs import FinishedRequestStats


class RequestTimes:
    """The timestamps of one request (kept on the scheduler's Request)."""

    __slots__ = ("arrival_s", "queued_s", "scheduled_s", "first_token_s", "last_token_s")

    def __init__(self, arrival_s: float, queued_s: float) -> None:
        self.arrival_s = arrival_s
        self.queued_s = queued_s
        self.scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None

    def queue_time_s(self) -> float | None:
        return None if self.scheduled_s is None else max(0.0, self.scheduled_s - self.queued_s)


class StepEvents:
    """Events since the last `take()`."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._reset()

    def _reset(self) -> None:
        self.finished: list[FinishedRequestStats] = []
        self.ttfts_s: list[float] = []
        self.itls_s: list[float] = []
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.step_tokens: list[int] = []
        self.step_durations_s: list[float] = []
        self.num_lora_swap_ins = 0
        self.kv_loads_s: list[tuple[str, float]] = []

    def kv_load(self, tier: str, seconds: float) -> None:
        self.kv_loads_s.append((tier, seconds))

    def times(self, arrival_s: float) -> RequestTimes:
        return RequestTimes(arrival_s, self.clock())

    def scheduled(self, times: RequestTimes) -> None:
        if times.scheduled_s is None:
            times.scheduled_s = self.clock()

    def token(self, times: RequestTimes, num_prompt_tokens: int, now_s: float, num_tokens: int = 1) -> None:
        """A step gave the request `num_tokens` (> 1: speculative decoding); one ITL per step, as vLLM's."""
        if times.first_token_s is None:
            times.first_token_s = now_s
            self.ttfts_s.append(now_s - times.arrival_s)
            self.num_prompt_tokens += num_prompt_tokens
        else:
            self.itls_s.append(now_s - times.last_token_s)
        times.last_token_s = now_s
        self.num_generation_tokens += num_tokens

    def step(self, num_tokens: int, duration_s: float) -> None:
        self.step_tokens.append(num_tokens)
        self.step_durations_s.append(duration_s)

    def finished_request(self, times: RequestTimes, finish_reason: str, num_prompt_tokens: int,
                         num_generation_tokens: int, num_preemptions: int) -> None:
        now_s = self.clock()
        scheduled, first, last = times.scheduled_s, times.first_token_s, times.last_token_s
        self.finished.append(FinishedRequestStats(
            finish_reason=finish_reason,
            e2e_s=max(0.0, now_s - times.arrival_s),
            queue_s=max(0.0, (scheduled if scheduled is not None else now_s) - times.queued_s),
            prefill_s=None if first is None or scheduled is None else first - scheduled,
            decode_s=None if first is None else last - first,
            inference_s=None if last is None or scheduled is None else last - scheduled,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=num_generation_tokens,
            num_preemptions=num_preemptions,
        ))

    def take(self) -> dict:
        """The SchedulerStats fields of the events since the last take."""
        fields = dict(
            finished=tuple(self.finished), ttfts_s=tuple(self.ttfts_s), itls_s=tuple(self.itls_s),
            num_prompt_tokens=self.num_prompt_tokens, num_generation_tokens=self.num_generation_tokens,
            step_tokens=tuple(self.step_tokens), step_durations_s=tuple(self.step_durations_s),
            num_lora_swap_ins=self.num_lora_swap_ins, kv_load_s=tuple(self.kv_loads_s),
        )
        self._reset()
        return fields
