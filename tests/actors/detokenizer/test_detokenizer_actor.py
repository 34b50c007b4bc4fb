"""The detokenizer actor alone in a nursery over inproc://, its peers faked.

The test plays the scheduler (sends TokenDeltas, reads FinishRequest and
profile replies) and the api (reads RequestOutputs) through inboxes bound
with the real transport and codec (support/fake_peers.py). The tokenizer
is the tiny synthetic checkpoint's; the profile deadline runs on trio's
MockClock.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import trio

from trillium.actors.detokenizer import actor as detokenizer
from trillium.actors.protocol.admin import ControlReply, StartProfile, StopProfile
from trillium.actors.protocol.outputs import DetokenizeSpec, RequestDelta, RequestOutputs, TokenDeltas
from trillium.actors.protocol.requests import FinishRequest
from trillium.config import EngineConfig
from trillium.models.tokenizer import load_tokenizer

from support.fake_peers import assert_shutdown_ends, inproc_config, run_alone

PROMPT = "Once upon a time"
TEXT = " there was a little robot who liked to count"


@pytest.fixture
def config(checkpoint):
    return inproc_config(EngineConfig(model=str(checkpoint("llama"))))


@pytest.fixture
def tokenizer(config):
    return load_tokenizer(config.engine.model)


def deltas(step: int, rid: str, tokens, *, spec=None, finish_reason=None) -> TokenDeltas:
    return TokenDeltas(step, (RequestDelta(rid, tuple(tokens), finish_reason=finish_reason, spec=spec),))


def spec(tokenizer, stop=()) -> DetokenizeSpec:
    prompt = np.asarray(tokenizer.encode(PROMPT), np.int32)
    return DetokenizeSpec(prompt, skip_special_tokens=True, stop=tuple(stop), include_stop_str_in_output=False)


async def test_token_deltas_become_text_for_the_api(config, tokenizer):
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    async with run_alone(detokenizer.run, config, "detokenizer") as peers:
        await peers.send(deltas(0, "a", tokens[:1], spec=spec(tokenizer)))
        for step, token in enumerate(tokens[1:-1], start=1):
            await peers.send(deltas(step, "a", [token]))
        await peers.send(deltas(len(tokens), "a", tokens[-1:], finish_reason="length"))
        text, finished = "", None
        while finished is None:
            outputs = await peers.receive("api")
            assert isinstance(outputs, RequestOutputs)
            (out,) = outputs.deltas
            text += out.text
            if out.finished:
                finished = out.finish_reason
        assert text == TEXT and finished == "length"
        assert peers.pending("scheduler") == [], "the scheduler ended it: nothing to tell it"


async def test_a_stop_string_finishes_the_request_and_later_tokens_are_dropped(config, tokenizer):
    tokens = tokenizer.encode(TEXT, add_special_tokens=False)
    async with run_alone(detokenizer.run, config, "detokenizer") as peers:
        await peers.send(deltas(0, "a", tokens, spec=spec(tokenizer, stop=("robot",))))
        finish = await peers.receive("scheduler")
        assert finish == FinishRequest(request_ids=("a",))
        (out,) = (await peers.receive("api")).deltas
        assert out.finished and out.finish_reason == "stop" and out.stop_reason == "robot"
        assert out.text == " there was a little "
        # A step already in flight, then the scheduler's own "stop" delta: both dropped.
        await peers.send(deltas(1, "a", tokens[:1]), deltas(2, "a", (), finish_reason="stop"))
        await peers.send(deltas(3, "b", (), finish_reason="abort"))  # a marker: rejected before any token
        (marker,) = (await peers.receive("api")).deltas
        assert marker.request_id == "b" and marker.finish_reason == "abort"


async def test_shutdown_ends_the_actor(config):
    await assert_shutdown_ends(detokenizer.run, config, "detokenizer", timeout_s=30)


async def test_the_profile_deadline_expires_on_trios_clock(config, autojump_clock, tmp_path):
    async with run_alone(detokenizer.run, config, "detokenizer") as peers:
        start = trio.current_time()
        await peers.send(StartProfile("p@detokenizer", profile_dir=str(tmp_path), max_duration_s=5))
        reply = await peers.receive("scheduler")
        assert isinstance(reply, ControlReply) and reply.ok and os.listdir(tmp_path) == []
        await trio.sleep_until(start + 4)
        assert os.listdir(tmp_path) == [], "still profiling"
        await trio.sleep_until(start + 6)
        written = sorted(os.listdir(tmp_path))
        assert any(name.endswith(".trace.json") for name in written), "expired: the files are written"
        await peers.send(StopProfile("s@detokenizer"))
        reply = await peers.receive("scheduler")
        assert reply.ok and sorted(os.path.basename(f) for f in reply.data["files"]) == written
