"""Sleep / wake, pause / resume, profiling, cache and abort routes on a real server.

While the engine sleeps or is paused the data plane answers 503 with
Retry-After; after the wake (or resume) greedy outputs are what they were.
A level-2 sleep discards the weights: waking needs a weight update first.
Pause modes: "keep" freezes a running stream, which then completes after
/resume; "abort" ends it. Profiling writes files; stopping without a start
is 409. Bad bodies are 400 naming the field.
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from support.admin_server import API_KEY, MAX_TOKENS, MODEL_NAME, PROMPTS


def _assert_refused(server, state: str) -> None:
    response = server.complete(PROMPTS[0], 4)
    assert response.status_code == 503, response.text
    assert int(response.headers["Retry-After"]) >= 1
    assert state in response.json()["error"]["message"]


def test_cp_sleep_wake_keeps_outputs(server, references, restore_base):
    before = server.greedy(PROMPTS, MAX_TOKENS)
    assert before == references["base"]
    reply = server.admin_ok("POST", "/sleep", json={"level": 1})
    assert reply["success"] and reply["state"] == "sleeping"
    assert server.admin_ok("GET", "/is_sleeping") == {"is_sleeping": True}
    _assert_refused(server, "sleeping")
    assert 'trillium:is_sleeping{model_name="cp-model"} 1.0' in server.admin("GET", "/metrics").text
    assert server.admin_ok("GET", "/server_info")["engine_state"] == "sleeping"
    server.admin_ok("POST", "/wake_up", json={"tags": ["weights"]})  # partial: still asleep
    assert server.admin_ok("GET", "/is_sleeping") == {"is_sleeping": True}
    _assert_refused(server, "sleeping")
    server.admin_ok("POST", "/wake_up", json={"tags": ["kv_cache"]})
    assert server.admin_ok("GET", "/is_sleeping") == {"is_sleeping": False}
    assert server.greedy(PROMPTS, MAX_TOKENS) == before


def test_cp_level2_sleep_needs_weights_before_wake(server, references, weights_root, restore_base):
    server.admin_ok("POST", "/sleep", json={"level": 2})
    refused = server.admin("POST", "/wake_up")
    assert refused.status_code == 409, refused.text
    server.admin_ok("POST", "/update_weights_from_disk", json={"model_path": str(weights_root / "base")})
    assert server.admin_ok("GET", "/is_sleeping") == {"is_sleeping": True}
    server.admin_ok("POST", "/wake_up")
    assert server.greedy(PROMPTS, MAX_TOKENS) == references["base"]


def _stream(server, max_tokens: int, started: threading.Event, result: dict) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    chunks = result["chunks"] = []
    with server.http.stream("POST", server.base_url + "/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        result["status"] = response.status_code
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                started.set()
    started.set()


def _start_stream(server, max_tokens: int):
    started, result = threading.Event(), {}
    thread = threading.Thread(target=_stream, args=(server, max_tokens, started, result), daemon=True)
    thread.start()
    assert started.wait(60)
    return thread, result


def test_cp_pause_keep_then_resume_completes(server, restore_base):
    thread, result = _start_stream(server, 240)  # the pause must land mid-stream on a loaded box
    server.admin_ok("POST", "/pause", json={"mode": "keep"})
    assert server.admin_ok("GET", "/is_paused") == {"is_paused": True}
    _assert_refused(server, "paused")
    assert thread.is_alive()  # frozen, not ended
    server.admin_ok("POST", "/resume")
    assert server.admin_ok("GET", "/is_paused") == {"is_paused": False}
    thread.join(60)
    finals = [c["choices"][0] for c in result["chunks"] if c["choices"] and c["choices"][0]["finish_reason"]]
    assert result["status"] == 200 and finals[-1]["finish_reason"] == "length"
    assert server.complete(PROMPTS[0], 4).status_code == 200


def test_cp_pause_abort_ends_streams(server, restore_base):
    thread, result = _start_stream(server, 240)
    assert server.admin_ok("POST", "/pause", json={"mode": "abort"})["state"] == "paused"
    thread.join(60)
    finals = [c["choices"][0] for c in result["chunks"] if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals and finals[-1]["finish_reason"] == "abort"
    server.admin_ok("POST", "/resume")
    assert server.complete(PROMPTS[0], 4).status_code == 200


def test_cp_abort_requests_by_id(server):
    thread, result = _start_stream(server, 240)
    request_id = result["chunks"][0]["id"]  # the response id is the engine request id
    reply = server.admin_ok("POST", "/abort_requests", json={"request_ids": [request_id, "no-such-id"]})
    assert reply["num_aborted"] == 1
    thread.join(60)
    assert result["chunks"][-1]["choices"][0]["finish_reason"] == "abort"


def test_cp_profiling(server):
    refused = server.admin("POST", "/stop_profile")
    assert refused.status_code == 409, refused.text
    started = server.admin_ok("POST", "/start_profile", json={"actors": ["scheduler", "executor"]})
    assert started["actors"] == ["scheduler", "executor"]
    assert server.admin("POST", "/start_profile").status_code == 409
    assert server.complete(PROMPTS[0], 4).status_code == 200
    stopped = server.admin_ok("POST", "/stop_profile")
    assert stopped["files"], stopped
    for path in stopped["files"]:
        assert os.path.isfile(path) and os.path.getsize(path) > 0, path
        assert path.startswith(stopped["profile_dir"])

    # "timeline": spans only (what bench/step_timeline.py reads): no cProfile, no torch.profiler.
    server.admin_ok("POST", "/start_profile", json={"timeline": True})
    assert server.complete(PROMPTS[0], 4).status_code == 200
    files = server.admin_ok("POST", "/stop_profile")["files"]
    assert len(files) == 3 and all(p.endswith(".trace.json") and not p.endswith(".pt.trace.json") for p in files)


def test_cp_reset_prefix_cache_and_info(server):
    server.greedy(PROMPTS[:1], 4)
    assert server.admin_ok("POST", "/reset_prefix_cache")["success"]
    info = server.admin_ok("GET", "/server_info")
    assert info["engine_state"] == "serving" and info["is_sleeping"] is False
    assert info["served_model_name"] == MODEL_NAME
    assert set(info["actors"]) == {"executor", "scheduler", "detokenizer"}
    for actor in info["actors"].values():
        assert actor["alive"] and os.path.exists(f"/proc/{actor['pid']}")
    assert info["engine_info"]["state"] == "serving"
    assert 0.0 <= info["kv_cache_usage"] <= 1.0
    metrics = server.admin("GET", "/metrics").text
    assert f'trillium:weight_version_info{{model_name="cp-model",weight_version="{info["weight_version"]}"}} 1.0' \
        in metrics
    assert 'trillium:engine_state{model_name="cp-model",state="serving"} 1.0' in metrics


@pytest.mark.parametrize("path, body, param", [
    ("/sleep", {"level": 5}, "level"),
    ("/sleep", {"level": 1, "mode": "later"}, "mode"),
    ("/wake_up", {"tags": ["gpu"]}, "tags.0"),
    ("/pause", {"mode": 1}, "mode"),
    ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights_from_disk", {"model_path": 7}, "model_path"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1], [2]]}, None),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 0}, "master_port"),
    ("/abort_requests", {"request_ids": "x"}, "request_ids"),
    ("/start_profile", {"actors": ["api"]}, "actors.0"),
])
def test_cp_bad_bodies_are_400(server, path, body, param):
    response = server.admin("POST", path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_cp_malformed_json_is_400(server):
    response = server.admin("POST", "/sleep", content=b"{level", headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]
