"""Engine lifecycle: the transition table and the pure EngineControl (no trio, no torch).

The controller is driven through the real SchedulerLoop, as the scheduler
actor drives it: messages in, sends out, `before_wait()` whenever the actor
would wait, and a tiny fake executor that samples token 9 wherever a
request is due.
"""

from __future__ import annotations

import pytest

from trillium.actors.protocol.execute import ExecuteBatch
from trillium.actors.protocol.admin import (
    AbortRequests,
    ControlReply,
    DestroyWeightsUpdateGroup,
    GetEngineInfo,
    InitWeightsUpdateGroup,
    Pause,
    ResetPrefixCache,
    Resume,
    SetWeightVersion,
    Sleep,
    StartProfile,
    StopProfile,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    WakeUp,
)
from trillium.actors.protocol.outputs import TokenDeltas
from trillium.actors.scheduler.engine_state import (
    RETURN,
    TRANSITIONS,
    EngineState,
    Op,
    next_state,
    next_weight_version,
    not_allowed_message,
)
from trillium.actors.scheduler.loop import Peer
from trillium.sampling_params import SamplingParams

from support.scheduler_loop import PARAMS, add_request, build_loop, fake_result

S = EngineState

# The specification, written out once more: (state, op) -> next state.
# Anything not listed must be refused.
EXPECTED = {
    S.SERVING: {
        Op.PAUSE: S.PAUSED, Op.DRAIN: S.DRAINING, Op.RESUME: S.SERVING, Op.SLEEP: S.SLEEPING,
        Op.WAKE_UP: S.SERVING, Op.UPDATE_WEIGHTS: S.UPDATING_WEIGHTS, Op.UPDATE_GROUP: S.SERVING,
        Op.PROFILE: S.SERVING, Op.LORA: S.SERVING,
    },
    S.PAUSED: {
        Op.PAUSE: S.PAUSED, Op.DRAIN: S.PAUSED, Op.RESUME: S.SERVING, Op.SLEEP: S.SLEEPING,
        Op.WAKE_UP: S.PAUSED, Op.UPDATE_WEIGHTS: S.UPDATING_WEIGHTS, Op.UPDATE_GROUP: S.PAUSED,
        Op.PROFILE: S.PAUSED, Op.LORA: S.PAUSED,
    },
    S.DRAINING: {
        Op.PAUSE: S.PAUSED, Op.DRAIN: S.DRAINING, Op.DRAINED: S.PAUSED, Op.RESUME: S.SERVING,
        Op.WAKE_UP: S.DRAINING, Op.UPDATE_GROUP: S.DRAINING, Op.PROFILE: S.DRAINING, Op.LORA: S.DRAINING,
    },
    S.SLEEPING: {
        Op.WAKE_UP: S.SLEEPING, Op.WOKEN: RETURN, Op.UPDATE_WEIGHTS: S.UPDATING_WEIGHTS,
        Op.UPDATE_GROUP: S.SLEEPING, Op.PROFILE: S.SLEEPING,
    },
    S.UPDATING_WEIGHTS: {Op.UPDATE_DONE: RETURN},
}
ANYTIME = (Op.RESET_PREFIX_CACHE, Op.ABORT_REQUESTS, Op.GET_INFO)


@pytest.mark.parametrize("state", list(EngineState))
@pytest.mark.parametrize("op", list(Op))
def test_transition_table_matches_the_specification(state, op):
    expected = EXPECTED[state].get(op, state if op in ANYTIME else None)
    assert next_state(state, op) is expected
    assert set(TRANSITIONS) == set(EngineState)


def test_refusals_name_the_state():
    assert "sleeping" in not_allowed_message(S.SLEEPING, Op.RESUME)
    assert "updating_weights" in not_allowed_message(S.UPDATING_WEIGHTS, Op.SLEEP)


@pytest.mark.parametrize(
    "previous, expected", [("0", "1"), ("9", "10"), ("step-9", "step-10"), ("abc", "abc.1"), ("v1.2", "v1.3")]
)
def test_next_weight_version(previous, expected):
    assert next_weight_version(previous) == expected


# -- the controller ---------------------------------------------------------

class Harness:
    """Drives the real SchedulerLoop (what the scheduler actor runs) around an
    EngineControl, with a fake executor; records what the loop sends."""

    def __init__(self) -> None:
        self.loop = build_loop()
        self.core, self.control = self.loop.core, self.loop.control
        self.replies: dict[str, ControlReply] = {}
        self.executor: list = []  # lifecycle messages sent to the executor
        self.detokenizer: list = []  # forwarded commands sent to the detokenizer
        self.batch = None  # the step in flight
        self.outstanding = False  # a lifecycle message is out on the executor
        self.joins: list = []  # InitWeightsUpdateGroup out on the executor: beside steps, not a job
        self.now = 0.0

    def apply(self, sends) -> None:
        for send in sends:
            message = send.message
            if send.to is Peer.API:
                if isinstance(message, ControlReply):
                    assert message.command_id not in self.replies, "answered twice"
                    self.replies[message.command_id] = message
            elif send.to is Peer.EXECUTOR:
                if isinstance(message, InitWeightsUpdateGroup):
                    assert not self.joins, "two joins out on the executor"
                    self.joins.append(message)
                    continue
                assert not self.outstanding and self.batch is None, "two messages out on the executor"
                if isinstance(message, ExecuteBatch):
                    self.batch = message
                else:
                    self.outstanding = True
                    self.executor.append(message)
            elif not isinstance(message, TokenDeltas):
                self.detokenizer.append(message)

    def deliver(self, message) -> None:
        """One message into the loop, as the actor hands it over."""
        self.apply(self.loop.handle(message, self.now))

    def send(self, command) -> ControlReply | None:
        self.deliver(command)
        self.advance()
        return self.replies.get(command.command_id)

    def add(self, rid: str, prompt=(1, 2, 3, 4, 5), params=PARAMS) -> None:
        self.deliver(add_request(rid, prompt, params))
        self.advance()

    def advance(self) -> None:
        """The actor is about to wait: the loop hands out the executor's next work."""
        self.apply(self.loop.before_wait(self.now))
        assert (self.batch is not None) == self.loop.step_in_flight

    def finish_step(self) -> None:
        batch, self.batch = self.batch, None
        self.deliver(fake_result(self.core, batch))
        self.advance()

    def run_steps(self, limit: int = 50) -> None:
        for _ in range(limit):
            if self.batch is None:
                return
            self.finish_step()
        raise AssertionError("still stepping")

    def answer(self, status: int = 200, **data) -> None:
        job = self.executor[-1]
        assert self.outstanding
        self.outstanding = False
        self.deliver(ControlReply(job.command_id, status, "", data))
        self.advance()

    def answer_join(self, status: int = 200, **data) -> None:
        """The executor's reply to the join out on it (the trainer came, or the timeout passed)."""
        join = self.joins.pop()
        self.deliver(ControlReply(join.command_id, status, "", data))
        self.advance()

    @property
    def state(self) -> EngineState:
        return self.control.state


def test_keep_pause_freezes_after_the_step_in_flight_and_resume_continues():
    h = Harness()
    h.add("a")
    assert h.batch is not None
    assert h.send(Pause("p", mode="keep")) is None, "replies once the step in flight is done"
    assert h.state is S.PAUSED
    h.finish_step()
    assert h.replies["p"].ok and h.replies["p"].data["state"] == "paused"
    assert h.batch is None and h.core.num_running == 1, "frozen with its blocks"
    h.add("b")
    assert h.batch is None and h.core.num_waiting == 1, "arrivals queue while paused"
    assert h.send(Resume("r")).ok
    assert h.state is S.SERVING and h.batch is not None
    h.run_steps()
    assert h.core.num_running == 0 and h.core.num_waiting == 0


def test_abort_pause_aborts_everything_and_later_arrivals_wait():
    h = Harness()
    h.add("a")
    h.add("b")
    h.send(Pause("p", mode="abort"))
    h.finish_step()
    assert h.replies["p"].data["num_aborted"] == 2
    assert h.core.request_ids() == []
    h.add("c")
    assert h.batch is None
    h.send(Resume("r"))
    h.run_steps()
    assert h.core.request_ids() == []


def test_wait_pause_drains_started_requests_and_holds_new_ones():
    h = Harness()
    h.add("a")
    assert h.send(Pause("p", mode="wait")) is None
    assert h.state is S.DRAINING
    h.add("late")
    h.run_steps()
    assert h.state is S.PAUSED and h.replies["p"].ok
    assert h.core.get_request("a") is None, "the started request finished"
    assert h.core.get_request("late") is not None and h.core.num_waiting == 1
    h.send(Resume("r"))
    h.run_steps()
    assert h.core.request_ids() == []


def test_during_a_drain_refused_commands_fail_fast_and_resume_cancels_it():
    h = Harness()
    h.add("a")
    h.send(Pause("p", mode="wait"))
    refused = h.send(Sleep("s", level=1))
    assert refused.status == 409 and "draining" in refused.message
    info = h.send(GetEngineInfo("i"))
    assert info.data["state"] == "draining" and info.data["num_running"] == 1
    assert h.send(Pause("p2", mode="wait")) is None, "allowed: waits for the same drain"
    assert h.send(Resume("r")).ok
    assert h.replies["p"].status == 409 and "cancelled by resume" in h.replies["p"].message
    assert h.replies["r"].data["state"] == "serving"
    assert h.state is S.DRAINING, "p2's turn came: its own drain"
    h.run_steps()
    assert h.replies["p2"].ok and h.state is S.PAUSED, "then ran on its own"


def test_a_keep_pause_cuts_a_drain_short():
    h = Harness()
    h.add("a", params=SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    h.send(Pause("p", mode="wait"))
    assert h.send(Pause("k", mode="keep")) is None
    assert h.state is S.PAUSED
    h.finish_step()
    assert h.replies["p"].ok and h.replies["k"].ok
    assert h.batch is None and h.core.num_running == 1, "frozen mid-way"


def test_an_abort_pause_cuts_a_wait_sleep_short_and_the_sleep_goes_on():
    h = Harness()
    h.add("a", params=SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    h.send(Sleep("s", level=1, mode="wait"))
    h.send(Pause("p", mode="abort"))
    h.finish_step()
    assert h.replies["p"].data["num_aborted"] == 1
    assert h.state is S.SLEEPING and isinstance(h.executor[-1], Sleep)
    h.answer(asleep=["kv_cache", "weights"])
    assert h.replies["s"].ok
    h.send(WakeUp("w"))
    h.answer(asleep=[])
    assert h.state is S.PAUSED, "the pause came after the sleep was asked for"


def test_sleep_runs_between_steps_and_wake_restores_the_state():
    h = Harness()
    h.add("a", params=SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    h.send(Sleep("s", level=1, mode="keep"))
    assert h.state is S.SLEEPING and h.executor == [], "waits for the step in flight"
    h.finish_step()
    assert isinstance(h.executor[-1], Sleep) and h.executor[-1].command_id == "s@executor"
    assert h.core.num_running == 0 and h.core.num_waiting == 1, "frozen request preempted: its KV goes away"
    assert h.core.pool.num_free_blocks == 64 and h.core.pool.num_cached_blocks == 0
    h.answer(asleep=["kv_cache", "weights"])
    assert h.replies["s"].data["sleep_level"] == 1 and h.replies["s"].data["is_sleeping"]
    refused = h.send(Resume("r"))
    assert refused.status == 409 and "sleeping" in refused.message
    assert h.send(Sleep("s2", level=2)).status == 409
    h.send(WakeUp("w1", tags=("kv_cache",)))
    h.answer(asleep=["weights"])
    assert h.state is S.SLEEPING and h.replies["w1"].data["asleep"] == ["weights"]
    h.send(WakeUp("w2", tags=("weights",)))
    h.answer(asleep=[])
    assert h.state is S.SERVING and h.replies["w2"].data["sleep_level"] == 0
    h.run_steps()
    assert h.core.request_ids() == [], "the frozen request recomputed and finished"


def test_wait_sleep_drains_then_sleeps_and_wakes_to_serving():
    h = Harness()
    h.add("a")
    h.send(Sleep("s", level=2, mode="wait"))
    assert h.state is S.DRAINING
    h.run_steps()
    assert h.state is S.SLEEPING and isinstance(h.executor[-1], Sleep)
    h.answer(asleep=["kv_cache", "weights"])
    h.send(WakeUp("w"))
    h.answer(status=409)  # the executor: level-2 weights not reloaded yet
    assert h.replies["w"].status == 409 and h.state is S.SLEEPING
    h.send(UpdateWeightsFromDisk("u", model_path="/models/m2"))
    assert h.state is S.UPDATING_WEIGHTS
    h.answer(num_tensors=3)
    assert h.state is S.SLEEPING and h.control.weight_version == "1"
    h.send(WakeUp("w2"))
    h.answer(asleep=[])
    assert h.state is S.SERVING and h.replies["w2"].data["model_path"] == "/models/m2"


def test_weight_update_while_serving_waits_for_the_step_and_blocks_steps():
    h = Harness()
    h.add("a", params=SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    h.send(UpdateWeightsFromDisk("u1", model_path="/x"))
    assert h.state is S.UPDATING_WEIGHTS and h.executor == []
    h.finish_step()
    assert isinstance(h.executor[-1], UpdateWeightsFromDisk) and h.batch is None
    refused = h.send(Pause("p", mode="keep"))
    assert refused.status == 409 and "updating_weights" in refused.message
    assert h.send(GetEngineInfo("i")).data["state"] == "updating_weights"
    h.answer()
    assert h.replies["u1"].data["weight_version"] == "1" and h.state is S.SERVING
    assert h.batch is not None, "stepping again, the running request kept its blocks"
    h.send(UpdateWeightsFromDisk("u2", model_path="/x", weight_version="v7"))
    h.finish_step()
    h.answer()
    assert h.control.weight_version == "v7"
    h.send(UpdateWeightsFromDisk("u3", model_path="/x"))
    h.finish_step()
    h.answer(status=400)
    assert h.replies["u3"].status == 400 and h.control.weight_version == "v7"
    assert h.state is S.SERVING
    stats = h.control.stats()
    assert (stats.engine_state, stats.weight_version) == ("serving", "v7")


def test_update_flushes_the_prefix_cache_unless_asked_not_to():
    h = Harness()
    h.add("a", prompt=tuple(range(1, 14)))
    h.run_steps()
    assert h.core.pool.num_cached_blocks > 0
    h.send(UpdateWeightsFromDisk("u1", model_path="/x", flush_cache=False))
    h.answer()
    assert h.core.pool.num_cached_blocks > 0
    h.send(UpdateWeightsFromDisk("u2", model_path="/x"))
    h.answer()
    assert h.core.pool.num_cached_blocks == 0


def test_bad_arguments_and_no_ops():
    h = Harness()
    assert h.send(Sleep("s", level=3)).status == 400
    assert h.send(Pause("p", mode="later")).status == 400
    assert h.send(WakeUp("w", tags=("brain",))).status == 400
    awake = h.send(WakeUp("w2"))
    assert awake.ok and "awake" in awake.message and h.executor == []
    assert h.send(Resume("r")).ok
    assert h.send(UpdateWeightsFromDistributed("d", ("x",), ("float32",), ((1,),))).status == 409
    assert h.send(DestroyWeightsUpdateGroup("g")).status == 409
    assert h.state is S.SERVING


def test_update_group_is_tracked():
    h = Harness()
    h.send(InitWeightsUpdateGroup("g", "127.0.0.1", 1234, rank_offset=1, world_size=2))
    h.answer_join()
    assert h.replies["g"].data["weights_update_group"] == "weight_update_group"
    assert h.send(InitWeightsUpdateGroup("g2", "127.0.0.1", 1234, rank_offset=1, world_size=2)).status == 409
    h.send(DestroyWeightsUpdateGroup("d"))
    h.answer()
    assert h.control.update_group is None


def test_a_pending_join_holds_neither_the_steps_nor_the_lane():
    h = Harness()
    h.add("a")
    assert h.batch is not None
    assert h.send(InitWeightsUpdateGroup("g", "127.0.0.1", 1234, rank_offset=1, world_size=2)) is None
    assert len(h.joins) == 1 and h.batch is not None, "sent at once, beside the step in flight"
    assert h.control.info()["weights_update_group_forming"] == "weight_update_group"
    h.add("b")
    h.run_steps()  # the requests run to the end while the trainer has not joined
    assert h.core.request_ids() == [] and "g" not in h.replies
    # Refused at once while it forms; other commands take the lane meanwhile.
    assert h.send(InitWeightsUpdateGroup("g2", "127.0.0.1", 1234, rank_offset=1, world_size=2)).status == 409
    assert h.send(UpdateWeightsFromDistributed("u", ("x",), ("float32",), ((1,),))).status == 409
    assert h.send(DestroyWeightsUpdateGroup("d")).status == 409
    assert h.send(Pause("p", mode="keep")).ok and h.send(Resume("r")).ok
    h.answer_join()
    assert h.replies["g"].ok and h.replies["g"].data["weights_update_group"] == "weight_update_group"
    assert h.replies["g"].data["weights_update_group_forming"] is None
    named = UpdateWeightsFromDistributed("u2", ("x",), ("float32",), ((1,),), group_name="other")
    assert h.send(named).status == 409, "SGLang's group_name must name the open group"
    assert h.send(DestroyWeightsUpdateGroup("d2", group_name="other")).status == 409
    h.send(DestroyWeightsUpdateGroup("d3", group_name="weight_update_group"))
    h.answer()
    assert h.replies["d3"].ok and h.control.update_group is None


def test_a_join_that_times_out_leaves_no_group():
    h = Harness()
    h.send(InitWeightsUpdateGroup("g", "127.0.0.1", 1234, rank_offset=1, world_size=2))
    h.answer_join(504)
    assert h.replies["g"].status == 504 and h.control.update_group is None
    assert h.replies["g"].data["weights_update_group_forming"] is None
    h.send(InitWeightsUpdateGroup("g2", "127.0.0.1", 1234, rank_offset=1, world_size=2))
    assert len(h.joins) == 1, "a new init may follow a failed one"


def test_abort_requests_and_reset_prefix_cache_skip_the_lane():
    h = Harness()
    h.add("a")
    h.add("b")
    h.send(Pause("p", mode="wait"))
    reply = h.send(AbortRequests("x", request_ids=("a", "nope")))
    assert reply.data["num_aborted"] == 1
    assert h.send(ResetPrefixCache("c")).ok
    h.send(AbortRequests("y"))
    h.run_steps()
    assert h.replies["p"].ok and h.core.request_ids() == []


def test_profile_forwards_and_gathers_files(tmp_path):
    h = Harness()
    assert h.send(StopProfile("s0")).status == 409
    h.send(StartProfile("p", profile_dir=str(tmp_path)))
    assert h.detokenizer[-1].command_id == "p@detokenizer"
    assert h.executor[-1].command_id == "p@executor"
    assert h.send(StartProfile("p2", profile_dir=str(tmp_path))) is None, "queued behind p"
    h.answer()
    h.deliver(ControlReply("p@detokenizer", 200, "", {"files": []}))
    h.advance()
    assert h.replies["p"].ok and h.replies["p2"].status == 409
    h.send(StopProfile("s"))
    h.answer(files=["/e.json"])
    h.deliver(ControlReply("s@detokenizer", 200, "", {"files": ["/d.json"]}))
    files = h.replies["s"].data["files"]
    assert "/e.json" in files and "/d.json" in files
    assert any(f.endswith(".prof") for f in files) and all(f.startswith("/") for f in files)
    assert h.send(StopProfile("s2")).status == 409


def test_profile_expires_and_a_new_one_may_start(tmp_path):
    h = Harness()
    h.send(StartProfile("p", profile_dir=str(tmp_path), actors=("scheduler",), max_duration_s=5))
    assert h.replies["p"].ok and h.control.profile_deadline == 5
    h.now = 6.0
    h.loop.deadline_passed(h.now)
    assert h.control.profile_deadline == float("inf")
    stopped = h.send(StopProfile("s"))
    assert stopped.ok and len(stopped.data["files"]) >= 1
    assert h.send(StartProfile("p2", profile_dir=str(tmp_path), actors=("scheduler",))).ok
    assert h.send(StopProfile("s2")).ok


# -- the weight update's drain (the api sends drain_timeout_s) ------------------

LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def test_a_serving_update_drains_every_request_first_then_returns_to_serving():
    h = Harness()
    h.add("a")
    h.add("b")  # arrives during a's first step: not started yet
    assert h.core.get_request("b").known_to_executor is False
    h.send(UpdateWeightsFromDisk("u", model_path="/x", drain_timeout_s=30))
    assert h.state is S.DRAINING and h.executor == []
    assert h.control.stats().engine_state is S.DRAINING
    resumed = h.send(Resume("r"))
    assert resumed.ok and h.state is S.DRAINING, "a resume does not cancel an update's drain"
    h.run_steps()
    assert h.core.request_ids() == [], "b ran too: a wait-pause would have held it"
    assert h.state is S.UPDATING_WEIGHTS and isinstance(h.executor[-1], UpdateWeightsFromDisk)
    assert h.control.deadline == float("inf")
    h.answer()
    assert h.replies["u"].ok and h.replies["u"].data["weight_version"] == "1"
    assert h.state is S.SERVING and h.control.stats().engine_state is S.SERVING
    h.add("c")
    assert h.batch is not None, "admission is open again"


def test_an_update_drain_aborts_what_is_left_at_its_deadline():
    h = Harness()
    h.now = 100.0
    h.add("a", params=LONG)
    h.send(UpdateWeightsFromDisk("u", model_path="/x", drain_timeout_s=5))
    assert h.control.deadline == 105.0
    h.finish_step()
    h.control.deadline_passed(104.0)
    assert h.core.request_ids() == ["a"], "not yet"
    h.now = 105.0
    h.control.deadline_passed(h.now)
    assert h.core.request_ids() == [] and h.control.deadline == float("inf")
    ended = h.core.take_pending_deltas()
    assert [(d.request_id, d.finish_reason) for d in ended.deltas] == [("a", "abort")]
    assert h.executor == [], "the update waits for the step in flight"
    h.finish_step()
    assert isinstance(h.executor[-1], UpdateWeightsFromDisk) and h.state is S.UPDATING_WEIGHTS
    h.answer()
    assert h.state is S.SERVING and h.control.weight_version == "1"


def test_an_update_without_a_drain_or_off_serving_runs_after_the_step_in_flight():
    h = Harness()
    h.send(UpdateWeightsFromDisk("u1", model_path="/x", drain_timeout_s=5))
    assert h.state is S.UPDATING_WEIGHTS, "nothing to wait for"
    h.answer()
    h.add("a", params=LONG)
    h.send(Pause("p", mode="keep"))
    h.finish_step()
    h.send(UpdateWeightsFromDisk("u2", model_path="/x", drain_timeout_s=5))
    assert h.state is S.UPDATING_WEIGHTS, "a paused engine is not drained"
    h.answer()
    assert h.state is S.PAUSED and h.core.request_ids() == ["a"], "the frozen request is kept"


def test_a_pause_cuts_an_update_drain_short_and_the_update_returns_to_paused():
    h = Harness()
    h.add("a", params=LONG)
    h.send(UpdateWeightsFromDisk("u", model_path="/x", drain_timeout_s=30))
    assert h.send(Pause("p", mode="keep")) is None and h.state is S.PAUSED
    h.finish_step()
    assert h.replies["p"].ok and isinstance(h.executor[-1], UpdateWeightsFromDisk)
    assert h.core.request_ids() == ["a"], "kept: the operator chose keep"
    h.answer()
    assert h.replies["u"].ok and h.state is S.PAUSED
    assert h.send(Resume("r")).ok and h.state is S.SERVING


def test_retract_pause_puts_running_requests_back_in_the_queue():
    # SGLang's pause_generation mode "retract": the requests survive, their KV is freed.
    h = Harness()
    h.add("a")
    h.add("b")  # arrives while a's first step is in flight: it waits
    h.send(Pause("p", mode="retract"))
    h.finish_step()
    assert h.replies["p"].data["num_retracted"] == 1 and h.replies["p"].data["num_aborted"] == 0
    assert h.core.num_running == 0 and h.core.num_waiting == 2
    assert h.core.num_free_blocks == h.control.engine.num_blocks
    assert h.send(Resume("r")).ok
    h.run_steps()
    assert h.core.request_ids() == []


def test_set_weight_version_renames_in_any_state():
    h = Harness()
    h.send(Pause("p", mode="keep"))
    reply = h.send(SetWeightVersion("v", "rl-step-3"))
    assert reply.ok and reply.data["weight_version"] == "rl-step-3" and h.state is S.PAUSED
    assert h.control.stats().weight_version == "rl-step-3"
