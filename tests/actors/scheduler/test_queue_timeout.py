"""--max-queue-time-s in the scheduler core: a request that waited past the deadline
without ever running ends "abort" with a queue_timeout reason (the api's 503); a
running or preempted one never does. vLLM has no such deadline; SGLang's
--max-queued-requests bounds only the count (python/sglang/srt/server_args.py)."""

from __future__ import annotations

import attrs

from support.fake_executor import FakeExecutor
from support.scheduler_harness import add_req
from trillium.actors.protocol.vocabulary import QUEUE_TIMEOUT_REASON
from trillium.actors.scheduler.core import Scheduler, SchedulerConfig
from trillium.actors.scheduler.metrics import StepEvents


def test_only_requests_that_never_ran_expire():
    now = [100.0]
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=1,
                                      max_queue_time_s=5.0), events=StepEvents(clock=lambda: now[0]))
    executor = FakeExecutor(64, 4)
    sched.add_request(attrs.evolve(add_req("running", range(8), max_tokens=40), arrival_time=100.0))
    sched.add_request(attrs.evolve(add_req("waiting", range(8), max_tokens=2), arrival_time=100.0))
    sched.update_from_output(executor.execute(sched.schedule()))  # "running" takes the only slot
    now[0] = 104.0
    sched.update_from_output(executor.execute(sched.schedule()))
    assert sched.take_pending_deltas() is None  # 4 s: not yet
    now[0] = 106.0
    sched.update_from_output(executor.execute(sched.schedule()))
    deltas = sched.take_pending_deltas().deltas
    assert [d.request_id for d in deltas] == ["waiting"] and deltas[0].finish_reason == "abort"
    assert deltas[0].stop_reason.startswith(QUEUE_TIMEOUT_REASON) and "--max-queue-time-s" in deltas[0].stop_reason
    assert sched.num_running == 1  # the running request is never dropped
