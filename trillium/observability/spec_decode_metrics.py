"""Speculative-decoding series for /metrics, read from the latest SchedulerStats.

vLLM's names (vllm/v1/spec_decode/metrics.py SpecDecodingProm) under this
server's `trillium:` prefix, as every other vLLM-named series here:

    trillium:spec_decode_num_drafts_total                 verifications with at least one draft
    trillium:spec_decode_num_draft_tokens_total           draft tokens verified
    trillium:spec_decode_num_accepted_tokens_total        draft tokens accepted
    trillium:spec_decode_num_accepted_tokens_per_pos_total{position}   accepted at draft position i
    trillium:spec_decode_num_steps_disabled_by_batch_size_total   (Trillium's) steps planned
        without drafts because more requests ran than disable_by_batch_size

Lifetime totals kept by the scheduler (speculative/scheduling.py), exported
at 0 when speculative decoding is off (no position series then). Acceptance
rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts
(vLLM's PromQL, in the README).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily


class SpecDecodeCollector:
    def __init__(self, model_name: str, stats: Callable[[], object]) -> None:
        self._model = model_name
        self._stats = stats

    def collect(self):
        stats = self._stats()
        model = self._model
        for name, doc, field in (
            ("trillium:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_decode_num_drafts_total"),
            ("trillium:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_decode_num_draft_tokens_total"),
            ("trillium:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
             "spec_decode_num_accepted_tokens_total"),
            ("trillium:spec_decode_num_steps_disabled_by_batch_size",
             "Steps run without speculation: more running requests than disable_by_batch_size.",
             "spec_decode_num_steps_disabled_by_batch_size_total"),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], getattr(stats, field, 0) if stats else 0)
            yield family
        per_pos = CounterMetricFamily("trillium:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=["model_name", "position"])
        for pos, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos_total if stats else ()):
            per_pos.add_metric([model, str(pos)], value)
        yield per_pos
