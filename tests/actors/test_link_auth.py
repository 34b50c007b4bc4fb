"""Unit tests of the engine links' security layer: link proofs, the sender
policy, the inbox gate, the secret's plumbing and the ipc directory sweep.

Pure where possible (link_auth, gate, senders); the mailbox test runs the real
transport over inproc://.
"""

from __future__ import annotations

import logging
import os
import stat

import msgpack
import numpy as np
import pytest
import trio

from trillium.actors.assembly import ActorConfig, Addresses, engine_codec
from trillium.actors.gate import Gate
from trillium.actors.ipc_dir import OWNER_FILE, PREFIX, make_ipc_dir, sweep_stale_ipc_dirs
from trillium.actors.link_auth import LinkKey, Signer, Verifier, AuthError
from trillium.actors.links import LinkConfigError, Links
from trillium.actors.protocol import ALL_MESSAGE_TYPES, admin
from trillium.actors.protocol.rejections import FramesRejected
from trillium.actors.protocol.requests import AbortRequest, AddRequest
from trillium.actors.protocol.supervision import Ping, Pong
from trillium.actors.protocol.senders import ROLES, may_send, sender_of
from trillium.actors.transport import Outbox
from trillium.config import EngineConfig
from trillium.sampling_params import SamplingParams

CODEC = engine_codec()
KEY = LinkKey.generate()


def _add_request(rid="r1", tokens=(1, 2, 3)) -> AddRequest:
    return AddRequest(request_id=rid, prompt_token_ids=np.asarray(tokens, dtype=np.int32),
                      sampling=SamplingParams(max_tokens=2), eos_token_ids=(), arrival_time=0.0)


def _bytes(frames):
    return [bytes(memoryview(f)) for f in frames]


# -- link_auth ------------------------------------------------------------------


def test_a_signed_message_verifies_with_its_role_and_decodes():
    message = admin.UpdateWeightsFromTensors("c1", np.arange(40_000, dtype=np.uint8))
    frames = _bytes(Signer(KEY, "api").sign(CODEC.encode(message)))
    role, body = Verifier(KEY, ROLES).verify(frames)
    assert role == "api"
    assert CODEC.decode(body).safetensors.tolist() == message.safetensors.tolist()


@pytest.mark.parametrize("tamper", ["wrong_key", "no_proof", "flip_envelope", "flip_tensor", "claim_other_role"])
def test_frames_without_a_valid_proof_are_refused(tamper):
    message = admin.UpdateWeightsFromTensors("c1", np.arange(40_000, dtype=np.uint8))
    key = LinkKey.generate() if tamper == "wrong_key" else KEY
    frames = _bytes(Signer(key, "api").sign(CODEC.encode(message)))
    if tamper == "no_proof":
        frames = frames[1:]
    elif tamper == "flip_envelope":
        frames[1] = frames[1][:-1] + bytes([frames[1][-1] ^ 1])
    elif tamper == "flip_tensor":
        frames[2] = bytes([frames[2][0] ^ 1]) + frames[2][1:]
    elif tamper == "claim_other_role":  # the api's MAC under the scheduler's name
        frames[0] = b"TRL1" + bytes([9]) + b"scheduler" + frames[0][8:]
    with pytest.raises(AuthError) as caught:
        Verifier(KEY, ROLES).verify(frames)
    assert caught.value.reason == "unauthenticated"


def test_a_replayed_frame_is_refused_and_a_later_one_passes():
    signer, verifier = Signer(KEY, "api"), Verifier(KEY, ROLES)
    first = _bytes(signer.sign(CODEC.encode(AbortRequest(("a",)))))
    second = _bytes(signer.sign(CODEC.encode(AbortRequest(("b",)))))
    verifier.verify(first)
    with pytest.raises(AuthError) as caught:
        verifier.verify(first)
    assert caught.value.reason == "replayed"
    assert CODEC.decode(verifier.verify(second)[1]).request_ids == ("b",)


def test_the_secret_never_shows_in_a_repr():
    config = ActorConfig(EngineConfig(model="/m"), Addresses.inproc())
    assert config.link_secret not in repr(config) and KEY.secret.hex() not in repr(KEY)
    from trillium.actors.assembly import engine_specs

    assert all(config.link_secret not in repr(spec) for spec in engine_specs(config))


def test_the_secret_travels_with_the_config_and_is_never_invented():
    config = ActorConfig(EngineConfig(model="/m"), Addresses.inproc())
    assert ActorConfig.from_bytes(config.to_bytes()).link_key() == config.link_key()
    other = ActorConfig(EngineConfig(model="/m"), Addresses.inproc())
    assert other.link_secret != config.link_secret  # one per run
    import json

    fields = json.loads(config.to_bytes())
    del fields["link_secret"]
    keyless = ActorConfig.from_bytes(json.dumps(fields).encode())
    assert keyless.link_key() is None
    for addresses in (Addresses.ipc("/tmp/x"), Addresses("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556",
                                                          "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")):
        with pytest.raises(LinkConfigError, match="no link secret"):
            Links(ActorConfig(keyless.engine, addresses, link_secret=None), "scheduler")


# -- sender policy ----------------------------------------------------------------


def test_only_the_api_may_send_lifecycle_commands_to_the_scheduler():
    commands = [m for m in admin.MESSAGES if m is not admin.ControlReply]
    for command in commands:
        assert may_send("scheduler", "api", command)
        assert not any(may_send("scheduler", role, command) for role in ROLES if role != "api")
    assert not may_send("executor", "api", admin.UpdateWeightsFromDisk)  # only forwarded by the scheduler
    assert not may_send("scheduler", "detokenizer", AddRequest)
    assert sender_of("scheduler", AddRequest) == "api"


def test_every_registered_message_has_a_sender_somewhere_except_the_unused_ones():
    used = {t for receiver in ROLES for role in ROLES for t in ALL_MESSAGE_TYPES if may_send(receiver, role, t)}
    unused = {t.__name__ for t in ALL_MESSAGE_TYPES} - {t.__name__ for t in used}
    # Nested field types travel inside others; Ping (api -> each actor) and Pong (back) are the
    # stall watchdog's (actors/liveness.py), so each has exactly its one direction.
    assert "AddRequest" not in unused and "FramesRejected" not in unused
    assert not {"Ping", "Pong"} & unused
    assert {r for r in ROLES if may_send(r, "api", Ping)} == {"scheduler", "executor", "detokenizer"}
    assert {r for r in ROLES if may_send("api", r, Pong)} == {"scheduler", "executor", "detokenizer"}
    assert not may_send("api", "scheduler", Ping) and not may_send("scheduler", "api", Pong)


# -- gate ----------------------------------------------------------------------------


def _gate(receiver="scheduler", cap=1 << 20) -> Gate:
    return Gate(receiver, CODEC, Verifier(KEY, ROLES), cap)


def test_the_gate_drops_bad_frames_by_reason_and_admits_good_ones():
    gate = _gate(cap=100_000)
    api, executor = Signer(KEY, "api"), Signer(KEY, "executor")
    assert gate.admit([b"\x00garbage bytes here\xff"]) is None
    assert gate.admit(CODEC.encode(_add_request())) is None  # well-formed, no proof
    assert gate.admit(Signer(LinkKey.generate(), "api").sign(CODEC.encode(_add_request()))) is None
    assert gate.admit(api.sign([msgpack.packb(["AddRequest", {"nonsense": 1}])])) is None
    assert gate.admit(api.sign([b"\xc1"])) is None
    assert gate.admit(executor.sign(CODEC.encode(_add_request()))) is None  # executor may not add requests
    assert gate.admit([b"x" * 100_001]) is None
    assert isinstance(gate.admit(api.sign(CODEC.encode(_add_request()))), AddRequest)
    assert dict(gate.report().totals) == {
        "unauthenticated": 2 + 1, "replayed": 0, "forbidden": 1, "undecodable": 2, "oversize": 1,
    }


def test_the_gate_logs_once_per_peer_and_reason(caplog):
    gate = _gate()
    with caplog.at_level(logging.WARNING, logger="trillium.actors.gate"):
        for _ in range(100):
            gate.admit([b"garbage"], "localhost:1000:1000:4242")
        gate.admit([b"garbage"], "localhost:1000:1000:4343")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "4242" in lines[0] and "unauthenticated" in lines[0] and "4343" in lines[1]
    assert dict(gate.report().totals)["unauthenticated"] == 101


async def test_a_mailbox_survives_garbage_and_reports_its_rejections():
    config = ActorConfig(EngineConfig(model="/m"), Addresses.inproc())
    api = Links(config, "api")
    api_mailbox = api.mailbox()
    scheduler_mailbox = Links(config, "scheduler").mailbox()
    raw = Outbox.connect(config.addresses.scheduler, CODEC)
    to_scheduler = api.outbox("scheduler")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(api_mailbox.pump)
        nursery.start_soon(scheduler_mailbox.pump)
        await raw.send_frames([b"\x00\x01garbage"])
        await raw.send(admin.StartProfile("c1", "/tmp/nope"))  # well-formed, no proof
        await to_scheduler.send(AbortRequest(("a",)))
        with trio.fail_after(10):
            assert (await scheduler_mailbox.receive()).request_ids == ("a",)
            report = await api_mailbox.receive()  # the scheduler's report to the api
        assert isinstance(report, FramesRejected) and report.actor == "scheduler"
        assert dict(report.totals)["unauthenticated"] == 2
        assert scheduler_mailbox.depth == 0
        nursery.cancel_scope.cancel()
    raw.close()
    to_scheduler.close()


# -- ipc directory ------------------------------------------------------------------


def test_the_ipc_dir_is_private_and_only_dead_owners_dirs_are_swept(tmp_path):
    mine = make_ipc_dir(str(tmp_path))
    assert stat.S_IMODE(os.stat(mine).st_mode) == 0o700
    with open(os.path.join(mine, OWNER_FILE)) as f:
        assert f.read().split()[0] == str(os.getpid())
    dead = tmp_path / f"{PREFIX}dead"
    dead.mkdir()
    (dead / OWNER_FILE).write_text("2147483646 1\n")  # no such pid
    recycled = tmp_path / f"{PREFIX}recycled"  # our pid, but another start time
    recycled.mkdir()
    (recycled / OWNER_FILE).write_text(f"{os.getpid()} 1\n")
    unknown = tmp_path / f"{PREFIX}unknown"  # no owner file: left alone
    unknown.mkdir()
    removed = sweep_stale_ipc_dirs(str(tmp_path))
    assert sorted(removed) == sorted([str(dead), str(recycled)])
    assert os.path.isdir(mine) and unknown.is_dir()


# -- the scheduler's own checks --------------------------------------------------------


@pytest.mark.parametrize("bad, message", [
    (dict(tokens=(1, 2, 1000)), "token ids must be in"),
    (dict(tokens=(-1, 2)), "token ids must be in"),
    (dict(tokens=()), "must not be empty"),
    (dict(tokens=tuple(range(64))), "do not fit max_model_len"),
    (dict(sampling=SamplingParams(max_tokens=2, top_p=7.0)), "top_p"),
    (dict(sampling=SamplingParams(max_tokens=62)), "exceeds max_model_len"),
    (dict(sampling=SamplingParams(max_tokens=2, n=0)), "'n'"),  # n > 1 is fine: the core expands it
])
def test_the_scheduler_rejects_a_bad_request_alone(bad, message):
    import attrs

    from trillium.actors.scheduler.core import Scheduler, SchedulerConfig

    core = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64, vocab_size=100))
    good = _add_request("good")
    wrong = attrs.evolve(_add_request("bad", bad.get("tokens", (1, 2, 3))),
                         **({"sampling": bad["sampling"]} if "sampling" in bad else {}))
    with pytest.raises(ValueError, match=message):
        core.add_request(wrong)
    core.add_request(good)
    assert core.schedule() is not None  # the good one runs
