"""SIGKILL and SIGSTOP of each engine process while a client streams, against a real `trillium serve`.

SIGKILL (executor, detokenizer, scheduler; one fresh server each): the open
stream ends with an SSE error event (503, code `engine_failed`, naming the
actor) and `[DONE]` instead of a cut connection, a non-streamed request
with n=2 gets a 503 with the same error; the server exits 1; no
engine process, no ipc socket directory and no temp file (its TMPDIR is the
test's) is left behind.

SIGSTOP (one server, each actor in turn, `--engine-stall-timeout-s 2`): the
stream ends with an error event naming the stalled actor, /health on both
ports answers 503 naming it, `trillium:engine_stalls_total{actor}` counts
it and `trillium:engine_stalled{actor}` is 1; after SIGCONT /health is 200
again, a new completion succeeds and `kv_cache_usage_perc` returns to 0 (the
failed request was aborted, its blocks freed). SIGTERM then exits 0 with
nothing left behind.

What vLLM does in the same place, for comparison: its AsyncLLM marks the
engine dead when the engine-core process goes away (vllm-project/vllm
vllm/v1/engine/exceptions.py EngineDeadError, raised into every open
request's output queue), and /health turns unhealthy; Trillium adds the
stall (no pong / no step) half, which vLLM leaves to
VLLM_ENGINE_ITERATION_TIMEOUT_S in vllm/envs.py (default 60 s, our default).
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from support.engine_faults import NonStreamedClient, StreamingClient, engine_pids, ipc_dir_of, metric, no_leftovers
from support.serve_process import ServeProcess
from support.waiting import wait_until

STALL_TIMEOUT_S = 2.0
ACTORS = ["executor", "detokenizer", "scheduler"]
LONG_CONTEXT = 32768
ADMIN_TOKEN = "fault-suite-admin-token"


@pytest.fixture(scope="module")
def model_path(checkpoint):
    # WHY a long context: a 30,000-token stream is still running when the signal lands.
    return str(checkpoint("llama", max_position_embeddings=LONG_CONTEXT))


def serve(model_path: str, tmp_dir) -> ServeProcess:
    """A server whose temp files (socket directory, uploads) all go under `tmp_dir` (TMPDIR)."""
    return ServeProcess(model_path, "--kv-cache-memory", "32MiB", "--executor-threads", "1",
                        "--engine-stall-timeout-s", str(STALL_TIMEOUT_S),
                        env={"TRILLIUM_ADMIN_TOKEN": ADMIN_TOKEN, "TMPDIR": str(tmp_dir)}).wait_healthy(timeout_s=300)


def ours(tmp_dir) -> list[str]:
    """Trillium's entries left in a server's TMPDIR (torch's own caches, torchinductor_*, are not ours)."""
    return sorted(entry.name for entry in tmp_dir.iterdir() if entry.name.startswith("trillium"))


def assert_engine_error(stream: StreamingClient, actor: str) -> None:
    assert stream.error is None, f"the connection was cut: {stream.error!r}"
    assert stream.status == 200
    error = stream.error_event
    assert error is not None, f"no error event; last events: {stream.events[-3:]}"
    assert error["code"] == "engine_failed" and actor in error["message"], error
    assert stream.events[-1] == "[DONE]"


@pytest.mark.parametrize("actor", [
    "executor", pytest.param("detokenizer", marks=pytest.mark.heavy), pytest.param("scheduler", marks=pytest.mark.heavy),
])
def test_sigkill_mid_stream_ends_streams_with_an_error_and_exits(model_path, actor, tmp_path):
    server = serve(model_path, tmp_path)
    pids, ipc_dir = engine_pids(server), ipc_dir_of(server)
    try:
        stream = StreamingClient(server)
        plain = NonStreamedClient(server)  # n=2: the merged choices path
        assert stream.first_chunk.wait(60) and stream.num_tokens > 0, stream.error
        wait_until(lambda: metric(server, "trillium:num_requests_running") >= 3, timeout_s=60, interval_s=0.05,
                   what="the non-streamed request's two choices to run")
        os.kill(pids[actor], signal.SIGKILL)
        stream.join(60)
        plain.join(60)
        assert_engine_error(stream, actor)
        assert plain.response is not None, f"the connection was cut: {plain.error!r}"
        assert plain.response.status_code == 503, plain.response.text
        error = plain.response.json()["error"]
        assert error["code"] == "engine_failed" and actor in error["message"], error
        assert server.process.wait(timeout=60) == 1, server.log()
    finally:
        server.stop()
    assert not no_leftovers(pids.values(), ipc_dir), no_leftovers(pids.values(), ipc_dir)
    assert ipc_dir.startswith(str(tmp_path)) and not ours(tmp_path), ours(tmp_path)
    assert f"actor {actor!r} failed" in server.log()


@pytest.mark.heavy
def test_sigstop_each_actor_is_a_named_stall_then_recovers(model_path, tmp_path):
    server = serve(model_path, tmp_path)
    pids, ipc_dir = engine_pids(server), ipc_dir_of(server)
    admin = httpx.Client(base_url=server.admin_url, timeout=30, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    try:
        for count, actor in enumerate(ACTORS, start=1):
            stream = StreamingClient(server)
            assert stream.first_chunk.wait(60) and stream.num_tokens > 0, stream.error
            stopped_at = time.monotonic()
            os.kill(pids[actor], signal.SIGSTOP)
            try:
                stream.join(60)
                assert_engine_error(stream, actor)
                # WHY a bound and no exact time: 2 s stall timeout + one ping interval + scheduling slack.
                assert time.monotonic() - stopped_at < 30
                health = httpx.get(server.base_url + "/health", timeout=10)
                assert health.status_code == 503 and actor in health.json()["detail"], health.text
                admin_health = admin.get("/health")
                assert admin_health.status_code == 503 and actor in admin_health.json()["detail"], admin_health.text
                assert metric(server, "trillium:engine_stalled", actor=actor) == 1
                assert metric(server, "trillium:engine_stalls_total", actor=actor) == 1
                refused = httpx.post(server.base_url + "/v1/completions", timeout=10,
                                     json={"model": "test-model", "prompt": "x", "max_tokens": 2})
                assert refused.status_code == 503, refused.text
            finally:
                os.kill(pids[actor], signal.SIGCONT)
            wait_until(lambda: httpx.get(server.base_url + "/health", timeout=5).status_code == 200,
                       timeout_s=30, interval_s=0.2, what=f"/health 200 after SIGCONT of the {actor}")
            assert metric(server, "trillium:engine_stalled", actor=actor) == 0
            ok = httpx.post(server.base_url + "/v1/completions", timeout=60,
                            json={"model": "test-model", "prompt": "Once", "max_tokens": 4})
            assert ok.status_code == 200, ok.text
            wait_until(lambda: metric(server, "trillium:kv_cache_usage_perc") == 0, timeout_s=30,
                       interval_s=0.1, what="the failed request's KV blocks to be freed")
            assert sum(metric(server, "trillium:engine_stalls_total", actor=a) for a in ACTORS) == count
    finally:
        for pid in pids.values():  # never leave a stopped process behind a failed assertion
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        admin.close()
        code = server.stop()
    assert code == 0, server.log()
    assert not no_leftovers(pids.values(), ipc_dir), no_leftovers(pids.values(), ipc_dir)
    assert ipc_dir.startswith(str(tmp_path)) and not ours(tmp_path), ours(tmp_path)
