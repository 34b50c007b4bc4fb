"""The stall watchdog's pure core (`trillium/actors/liveness.py` StallDetector) and the stream failure path.

Time is passed in (seconds); no trio clock, no processes. Covers: a ping left
unanswered past the timeout names that actor and counts one onset; an answer
clears it; work queued with no progress names the executor (requests
running) or the scheduler (none running); no work, or a paused / sleeping
engine, is never a stall; a step stall stays until progress arrives, even
once the queue was emptied by failing the streams. And `RequestStream`: a
failed stream yields what it already received, then raises EngineFailed.
"""

from __future__ import annotations

import pytest
import trio

from trillium.actors.client import EngineFailed, RequestStream
from trillium.actors.liveness import ENGINE_ACTORS, StallDetector
from trillium.actors.protocol.outputs import RequestOutputDelta

TIMEOUT_S = 5.0


def check(detector: StallDetector, now: float, pongs: dict, *, progress: float = 0.0, queued: int = 0,
          steppable: bool = True, running: int = 0):
    return detector.check(now, last_pong_s=pongs, last_progress_s=progress, num_queued=queued,
                          steppable=steppable, num_running=running)


def test_unanswered_ping_names_the_actor_once():
    detector = StallDetector(ENGINE_ACTORS, TIMEOUT_S)
    pongs = {actor: 0.5 for actor in ENGINE_ACTORS}
    for now in range(1, 12):
        detector.pinged(float(now), pongs)
        for actor in ("executor", "scheduler"):
            pongs[actor] = now + 0.1  # these answer; the detokenizer went quiet after t=0.5
        stall = check(detector, now + 0.5, pongs)
        if now + 0.5 - 1.0 <= TIMEOUT_S:
            assert stall is None, now
    assert stall is not None and stall.actor == "detokenizer"
    assert "did not answer a ping" in str(stall)
    assert detector.num_stalls == {"executor": 0, "detokenizer": 1, "scheduler": 0}
    pongs["detokenizer"] = 12.0
    detector.pinged(12.5, pongs)
    assert check(detector, 12.6, pongs) is None
    assert detector.num_stalls["detokenizer"] == 1


@pytest.mark.parametrize(("running", "actor"), [(3, "executor"), (0, "scheduler")])
def test_no_progress_with_work_queued(running, actor):
    detector = StallDetector(ENGINE_ACTORS, TIMEOUT_S)
    assert check(detector, 10.0, {}, progress=9.0, queued=2, running=running) is None
    assert check(detector, 14.0, {}, progress=9.0, queued=2, running=running) is None
    stall = check(detector, 14.5, {}, progress=9.0, queued=2, running=running)
    assert stall is not None and stall.actor == actor and "2 requests queued" in stall.reason
    # The streams were failed (queue empty): still stalled until the engine shows progress.
    assert check(detector, 20.0, {}, progress=9.0, queued=0) == stall
    assert check(detector, 21.0, {}, progress=20.5, queued=0) is None
    assert detector.num_stalls[actor] == 1


def test_a_frozen_scheduler_is_named_by_its_ping_not_blamed_on_the_executor():
    # The scheduler froze at t=10: steps stop at once, its first unanswered ping went at t=11.
    detector = StallDetector(ENGINE_ACTORS, TIMEOUT_S)
    pongs = {actor: 10.0 for actor in ENGINE_ACTORS}
    for now in range(11, 18):
        detector.pinged(float(now), pongs)
        pongs["executor"] = pongs["detokenizer"] = now + 0.1
        stall = check(detector, now + 0.9, pongs, progress=10.0, queued=1, running=1)
        if now + 0.9 - 11 <= TIMEOUT_S:
            assert stall is None, now  # the step clock ran out at t=15: not the executor's fault
    assert stall is not None and stall.actor == "scheduler" and "ping" in stall.reason
    assert detector.num_stalls == {"executor": 0, "detokenizer": 0, "scheduler": 1}


def test_a_hung_step_with_every_ping_answered_is_the_executor():
    detector = StallDetector(ENGINE_ACTORS, TIMEOUT_S)
    pongs = {actor: 10.0 for actor in ENGINE_ACTORS}
    for now in range(11, 18):
        detector.pinged(float(now), pongs)
        pongs = {actor: now + 0.1 for actor in ENGINE_ACTORS}
        stall = check(detector, now + 0.9, pongs, progress=10.0, queued=1, running=1)
    assert stall is not None and stall.actor == "executor" and "step did not come back" in stall.reason


def test_progress_from_before_the_watch_began_is_not_a_stall():
    # The scheduler reported stats at t=3 while the executor loaded; the watch began at t=10
    # and the first requests came in then: the step clock starts at 10, not 3.
    detector = StallDetector(ENGINE_ACTORS, TIMEOUT_S)
    detector.watching_from(10.0)
    assert check(detector, 10.5, {}, progress=3.0, queued=2, running=0) is None
    assert check(detector, 14.9, {}, progress=3.0, queued=2, running=0) is None
    assert check(detector, 15.5, {}, progress=3.0, queued=2, running=0).actor == "scheduler"
    unwatched = StallDetector(ENGINE_ACTORS, TIMEOUT_S)
    assert check(unwatched, 10.5, {}, progress=3.0, queued=2, running=0) is not None


def test_no_work_or_not_stepping_is_not_a_stall():
    detector = StallDetector(ENGINE_ACTORS, TIMEOUT_S)
    assert check(detector, 100.0, {}, progress=0.0, queued=0) is None
    # Paused / sleeping / updating weights with requests waiting: no steps are due.
    assert check(detector, 200.0, {}, progress=0.0, queued=4, steppable=False) is None
    # Work became due at t=200 (the clock starts then, not at the last progress).
    assert check(detector, 204.0, {}, progress=0.0, queued=4) is None
    assert check(detector, 205.5, {}, progress=0.0, queued=4, running=1).actor == "executor"


def test_progress_keeps_it_healthy():
    detector = StallDetector(ENGINE_ACTORS, TIMEOUT_S)
    for now in range(0, 60, 2):
        assert check(detector, float(now), {}, progress=now - 1.0, queued=8, running=8) is None


async def test_failed_stream_yields_then_raises():
    stream = RequestStream("r")
    stream._push(RequestOutputDelta("r", "a", (1,), finished=False))
    stream._fail(EngineFailed("engine actor 'executor' failed"))
    received = []
    with pytest.raises(EngineFailed, match="executor"):
        async for delta in stream:
            received.append(delta.text)
    assert received == ["a"] and stream.finished


async def test_finished_stream_is_not_failed():
    stream = RequestStream("r")
    stream._push(RequestOutputDelta("r", "a", (1,), finished=True, finish_reason="stop"))
    stream._fail(EngineFailed("late"))
    with trio.fail_after(1):
        assert [d.text async for d in stream] == ["a"]
