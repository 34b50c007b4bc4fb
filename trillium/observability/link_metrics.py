"""`trillium:engine_rejected_frames_total{actor,reason}`: frames the engine's inboxes dropped.

Each engine inbox's gate (actors/gate.py) counts the frames it drops by
reason (protocol/rejections.py REJECT_REASONS); the actors report their
lifetime totals to the api (FramesRejected), whose EngineClient keeps the
latest per actor (`rejected_frames()`). This collector reads them at scrape
time: every actor x reason series exists from start-up, at 0, so `rate()`
has a baseline and a dashboard panel never says "no data".
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily

from trillium.actors.protocol.rejections import REJECT_REASONS
from trillium.actors.protocol.senders import ROLES


class RejectedFramesCollector:
    def __init__(self, model_name: str, rejected_frames: Callable[[], dict[str, dict[str, int]]],
                 actors: tuple[str, ...] = ROLES) -> None:
        self._model_name = model_name
        self._rejected_frames = rejected_frames
        self._actors = actors  # data_parallel/remote.py: ("dp-join",), the join socket's

    def collect(self):
        family = CounterMetricFamily(
            "trillium:engine_rejected_frames",
            "Frames an engine inbox dropped: unauthenticated, replayed, forbidden (the sender's role may "
            "not send that message), undecodable, oversize.",
            labels=["model_name", "actor", "reason"],
        )
        totals = self._rejected_frames()
        for actor in self._actors:
            counts = totals.get(actor, {})
            for reason in REJECT_REASONS:
                family.add_metric([self._model_name, actor, reason], counts.get(reason, 0))
        yield family
