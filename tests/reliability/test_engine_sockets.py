"""Garbage, oversize and forged frames on every engine socket of a live `trillium serve`.

The attacker is a process of the same user that finds the server's ipc://
sockets (in its 0700 ``trillium-ipc-*`` directory) but not the run's link
secret (handed to the children on stdin; actors/link_auth.py). It pushes
to each socket: random bytes, multi-frame garbage, messages encoded with
the engine's own codec but without a link proof, and the same with a proof
under another secret. Afterwards:

- every engine process is still alive and /health is 200;
- a completion still returns the right greedy tokens (the same as before);
- nothing the forged messages asked for happened: no weight update (the
  weight version stays), no profile directory, no engine request (the token
  counters moved by exactly the real completions), no actor shut down;
- `trillium:engine_rejected_frames_total{actor,reason}` counts the drops.

A frame over an inbox's ZMQ_MAXMSGSIZE is dropped by ZeroMQ, with the
connection that sent it, before it is read into memory: the server keeps
serving (ZeroMQ reports no event that tells it apart from a normal close,
so this one is not counted; unit tests cover the counted "oversize" of a
multipart message in tests/actors/test_link_auth.py).
"""

from __future__ import annotations

import glob
import os
import re
import time

import httpx
import numpy as np
import pytest
import zmq

from support.serve_process import ServeProcess, child_pids, is_alive
from support.waiting import wait_until
from trillium.actors.assembly import engine_codec
from trillium.actors.ipc_dir import OWNER_FILE, PREFIX
from trillium.actors.link_auth import LinkKey, Signer
from trillium.actors.protocol import admin, outputs
from trillium.actors.protocol.requests import AddRequest
from trillium.actors.protocol.senders import MAX_MESSAGE_BYTES
from trillium.actors.protocol.supervision import Shutdown
from trillium.sampling_params import SamplingParams

TOKEN = "reliability-admin-token"
SOCKETS = ("scheduler", "executor", "detokenizer", "api")
CODEC = engine_codec()
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def stale_ipc_dir():
    """A dead server's socket directory, left behind by a SIGKILL: its owner pid does not exist."""
    import tempfile

    directory = tempfile.mkdtemp(prefix=PREFIX)
    with open(os.path.join(directory, OWNER_FILE), "w") as f:
        f.write("2147483646 1\n")
    open(os.path.join(directory, "scheduler"), "w").close()
    return directory


@pytest.fixture(scope="module")
def server(checkpoint, stale_ipc_dir):
    proc = ServeProcess(str(checkpoint("llama")), "--admin-token", TOKEN, "--no-enable-prefix-caching",
                        "--kv-cache-memory", "4MiB", "--executor-threads", "1").wait_healthy(timeout_s=300)
    yield proc
    directory = _ipc_dir(proc)
    assert proc.stop() == 0, proc.log()
    assert not os.path.exists(directory)  # a clean exit removes its own


def test_a_dead_servers_ipc_dir_is_swept_at_start(server, stale_ipc_dir):
    assert not os.path.exists(stale_ipc_dir)
    assert os.path.isdir(_ipc_dir(server))  # its own, with a live owner, stays


def _ipc_dir(server: ServeProcess) -> str:
    for directory in glob.glob(f"/tmp/{PREFIX}*"):
        try:
            with open(os.path.join(directory, OWNER_FILE)) as f:
                if f.read().split()[0] == str(server.process.pid):
                    return directory
        except OSError:
            continue
    raise AssertionError("no ipc directory owned by the server")


def _push(path: str, *messages: list, copy: bool = True) -> None:
    """Connect to the socket at `path` as a stranger would and push each multipart message."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDTIMEO, 5000)
    sock.connect(f"ipc://{path}")
    try:
        for frames in messages:
            sock.send_multipart(frames, copy=copy)
    finally:
        sock.close(linger=5000)


def _samples(server: ServeProcess) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[re.sub(r'model_name="[^"]*",?', "", key)] = float(value)
    return out


def _rejected(server: ServeProcess, actor: str, reason: str) -> float:
    return _samples(server)[f'trillium:engine_rejected_frames_total{{actor="{actor}",reason="{reason}"}}']


def _complete(server: ServeProcess) -> dict:
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _engine_alive(server: ServeProcess) -> None:
    children = child_pids(server.process.pid)
    assert len(children) == 3 and all(is_alive(pid) for pid in children), server.log()
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200


def _forgeries(message) -> list[list[bytes]]:
    """`message` encoded by the engine's codec: with no proof, and with a proof under another secret."""
    encoded = [bytes(memoryview(f)) for f in CODEC.encode(message)]
    stranger = Signer(LinkKey.generate(), "api")
    return [encoded, [bytes(memoryview(f)) for f in stranger.sign(encoded)]]


GARBAGE = [[os.urandom(20)], [b""], [b"\x92\xa4junk\xc1", os.urandom(300)], [b"TRL1\x03api" + os.urandom(48), b"x"]]


def test_garbage_on_every_engine_socket_is_dropped_and_counted(server):
    expected = _complete(server)["choices"][0]["text"]
    directory = _ipc_dir(server)
    assert os.stat(directory).st_mode & 0o777 == 0o700
    before = {actor: _rejected(server, actor, "unauthenticated") for actor in SOCKETS}
    for actor in SOCKETS:
        _push(os.path.join(directory, actor), *GARBAGE)
    wait_until(lambda: all(_rejected(server, a, "unauthenticated") >= before[a] + len(GARBAGE) for a in SOCKETS),
               timeout_s=30, interval_s=0.2, what="every inbox to count the garbage", detail=server.log)
    _engine_alive(server)
    assert _complete(server)["choices"][0]["text"] == expected
    assert "dropped a frame from localhost:" in server.log()  # the peer (uid, gid, pid) is logged


def test_forged_admin_commands_requests_and_shutdowns_do_nothing(server, tmp_path):
    expected = _complete(server)["choices"][0]["text"]
    directory = _ipc_dir(server)
    profile_dir = tmp_path / "forged-profile"
    forged_scheduler = [
        admin.UpdateWeightsFromDisk("forged-1", str(tmp_path), weight_version="forged"),
        admin.StartProfile("forged-2", str(profile_dir), max_duration_s=1.0),
        admin.SetWeightVersion("forged-3", "forged"),
        admin.Sleep("forged-4", level=2),
        AddRequest(request_id="forged-5", prompt_token_ids=np.asarray([5, 6, 7], dtype=np.int32),
                   sampling=SamplingParams(max_tokens=50, ignore_eos=True), eos_token_ids=(), arrival_time=0.0),
        Shutdown("forged"),
    ]
    forged_others = {
        "executor": [Shutdown("forged"), admin.UpdateWeightsFromDisk("forged-6", str(tmp_path))],
        "detokenizer": [Shutdown("forged"), admin.StartProfile("forged-7", str(profile_dir))],
        "api": [outputs.RequestOutputs(()), admin.ControlReply("forged-8")],
    }
    before_samples = _samples(server)
    before = {actor: _rejected(server, actor, "unauthenticated") for actor in SOCKETS}
    sent = {"scheduler": [f for m in forged_scheduler for f in _forgeries(m)]}
    sent.update({actor: [f for m in messages for f in _forgeries(m)] for actor, messages in forged_others.items()})
    for actor, frames in sent.items():
        _push(os.path.join(directory, actor), *frames)
    wait_until(lambda: all(_rejected(server, a, "unauthenticated") >= before[a] + len(sent[a]) for a in SOCKETS),
               timeout_s=30, interval_s=0.2, what="every forged frame to be counted", detail=server.log)
    time.sleep(1.5)  # past the forged profile's max_duration_s, had it started
    _engine_alive(server)
    assert _complete(server)["choices"][0]["text"] == expected
    after = _samples(server)
    assert not profile_dir.exists()
    health = httpx.get(server.admin_url + "/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert health.json()["weight_version"] != "forged" and health.json()["engine_state"] == "serving"
    # Exactly the one real completion ran: its 5 prompt and 6 generated tokens.
    assert after["trillium:prompt_tokens_total{}"] - before_samples["trillium:prompt_tokens_total{}"] == len(PROMPT)
    assert after["trillium:generation_tokens_total{}"] - before_samples["trillium:generation_tokens_total{}"] == 6
    assert after["trillium:num_requests_running{}"] == 0 and after["trillium:num_requests_waiting{}"] == 0


def test_a_frame_over_the_size_cap_is_dropped_before_it_is_read(server):
    expected = _complete(server)["choices"][0]["text"]
    path = os.path.join(_ipc_dir(server), "detokenizer")
    # np.zeros: calloc'd pages, never written, so the 1 GiB costs no memory here.
    _push(path, [np.zeros(MAX_MESSAGE_BYTES["detokenizer"] + 1, dtype=np.uint8)], copy=False)
    _engine_alive(server)
    assert _complete(server)["choices"][0]["text"] == expected
