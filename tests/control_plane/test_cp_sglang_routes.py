"""SGLang's admin routes, names and bodies, against a real `trillium serve`.

Routes, methods and bodies are those of sgl-project/sglang
python/sglang/srt/entrypoints/http_server.py (/pause_generation,
/continue_generation, /release_memory_occupation, /resume_memory_occupation,
/flush_cache GET and POST, /abort_request, /get_weight_version,
/update_weight_version, /health_generate, /get_server_info, /get_model_info,
/get_load) and python/sglang/srt/entrypoints/v1_loads.py (/v1/loads); the
body fields those of python/sglang/srt/managers/io_struct.py
(PauseGenerationReqInput.mode, Release/ResumeMemoryOccupationReqInput.tags,
AbortReq.rid / abort_all, UpdateWeightVersionReqInput.new_version,
UpdateWeightsFromTensorReqInput.serialized_named_tensors) and the memory
tags of python/sglang/srt/constants.py (weights, kv_cache, cuda_graph).
Each test checks the route's effect, not only its answer.
"""

from __future__ import annotations

import re

from support.admin_server import API_KEY, MAX_TOKENS, MODEL_NAME, PROMPTS, free_port, final_reason, start_stream

LONG_PROMPT = "The little dog ran to the big red barn and " * 8  # several KV blocks


def _prefix_hits(server) -> float:
    # /metrics sits behind the data plane's --api-key like everything but the probes.
    text = server.http.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return sum(float(m) for m in re.findall(r"^trillium:prefix_cache_hits_total\S* (\S+)$", text, re.M))


def test_cp_pause_generation_modes(server, restore_base):
    thread, result = start_stream(server, 240)
    reply = server.admin_ok("POST", "/pause_generation", json={"mode": "abort"})
    assert reply["status"] == "ok" and reply["message"] == "Generation paused successfully."
    thread.join(60)
    assert final_reason(result) == "abort"
    assert server.admin_ok("POST", "/continue_generation")["message"] == "Generation continued successfully."

    for mode, retracted in (("in_place", 0), ("retract", 1)):
        thread, result = start_stream(server, 240)  # the pause must land mid-stream on a loaded box
        reply = server.admin_ok("POST", "/pause_generation", json={"mode": mode})
        assert reply["state"] == "paused" and reply["num_retracted"] == retracted, reply
        thread.join(1.0)
        assert thread.is_alive(), mode  # kept (in place) or back in the queue (retract), not aborted
        if mode == "retract":
            assert server.admin("POST", "/flush_cache").status_code == 200  # SGLang: flushable when retracted
        server.admin_ok("POST", "/continue_generation")
        thread.join(60)
        assert result["status"] == 200 and final_reason(result) == "length", mode
    bad = server.admin("POST", "/pause_generation", json={"mode": "keep"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode"


def test_cp_release_and_resume_memory_occupation(server, references, restore_base):
    server.admin_ok("POST", "/release_memory_occupation", json={})  # tags null: all
    assert server.admin_ok("GET", "/is_sleeping") == {"is_sleeping": True}
    assert server.complete(PROMPTS[0], 4).status_code == 503
    assert server.admin("GET", "/health_generate").status_code == 503
    server.admin_ok("POST", "/resume_memory_occupation", json={"tags": ["weights"]})
    assert server.admin_ok("GET", "/is_sleeping") == {"is_sleeping": True}
    server.admin_ok("POST", "/resume_memory_occupation", json={"tags": ["kv_cache"]})
    assert server.admin_ok("GET", "/is_sleeping") == {"is_sleeping": False}
    assert server.greedy(PROMPTS, MAX_TOKENS) == references["base"]

    # One tag: only that memory goes (verl releases the KV cache and keeps the weights for a push).
    reply = server.admin_ok("POST", "/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert reply["asleep"] == ["kv_cache"]
    server.admin_ok("POST", "/resume_memory_occupation", json={"tags": ["kv_cache"]})
    assert server.greedy(PROMPTS, MAX_TOKENS) == references["base"]

    refused = server.admin("POST", "/release_memory_occupation", json={"tags": ["cuda_graph"]})
    assert refused.status_code == 400 and "cuda_graph" in refused.json()["error"]["message"]
    assert server.admin_ok("GET", "/is_sleeping") == {"is_sleeping": False}


def test_cp_flush_cache_resets_the_prefix_cache(server):
    for method in ("GET", "POST"):
        assert server.complete(LONG_PROMPT, 2).status_code == 200
        before = _prefix_hits(server)
        assert server.complete(LONG_PROMPT, 2).status_code == 200
        assert _prefix_hits(server) > before  # cached
        response = server.admin(method, "/flush_cache")
        assert response.status_code == 200 and response.text.startswith("Cache flushed.")
        before = _prefix_hits(server)
        assert server.complete(LONG_PROMPT, 2).status_code == 200
        assert _prefix_hits(server) == before  # nothing left to hit
    assert server.admin("GET", "/flush_cache?timeout=-1").status_code == 400


def test_cp_abort_request_by_rid(server):
    thread, result = start_stream(server, 240)
    other, other_result = start_stream(server, 60)
    reply = server.admin_ok("POST", "/abort_request", json={"rid": result["chunks"][0]["id"]})
    assert reply["num_aborted"] == 1
    thread.join(60)
    other.join(60)
    assert final_reason(result) == "abort" and final_reason(other_result) == "length"
    thread, result = start_stream(server, 240)
    server.admin_ok("POST", "/abort_request", json={"abort_all": True})
    thread.join(60)
    assert final_reason(result) == "abort"
    assert server.admin("POST", "/abort_request", json={}).status_code == 400


def test_cp_update_weight_version(server):
    reply = server.admin_ok("POST", "/update_weight_version", json={"new_version": "rl-step-7"})
    assert reply == {**reply, "success": True, "new_version": "rl-step-7",
                     "message": "Weight version updated to rl-step-7"}
    assert server.admin_ok("GET", "/get_weight_version") == {"weight_version": "rl-step-7"}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    models = server.http.get(server.base_url + "/v1/models", headers=auth).json()["data"]
    assert {m["weight_version"] for m in models} == {"rl-step-7"}
    assert server.complete(PROMPTS[0], 2).json()["weight_version"] == "rl-step-7"
    assert server.admin("POST", "/update_weight_version", json={"version": "x"}).status_code == 400


def test_cp_pickled_tensor_payload_is_refused(server):
    body = {"serialized_named_tensors": ["gASVAAAAAAAAAAB9lC4="], "load_format": None, "flush_cache": True}
    response = server.admin("POST", "/update_weights_from_tensor", json=body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "pickle" in message and "safetensors" in message and "update_weights_from_distributed" in message
    assert response.json()["success"] is False


def test_cp_string_numbers_are_coerced(server):
    # AReaL sends master_port (and world_size) as strings; SGLang's lax models accept them.
    response = server.admin("POST", "/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": str(free_port()), "world_size": "2", "rank_offset": "1",
        "group_name": "areal", "backend": "gloo", "timeout_s": "2",
    })
    assert response.status_code == 504, response.text  # accepted: the rendezvous itself timed out
    bad = server.admin("POST", "/init_weights_update_group",
                       json={"master_address": "127.0.0.1", "master_port": "port"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "master_port"


def test_cp_info_and_load_routes(server):
    assert server.admin("GET", "/health_generate").status_code == 200
    info = server.admin_ok("GET", "/get_server_info")
    assert info["model_path"] and info["served_model_name"] == MODEL_NAME and info["tp_size"] == 1
    assert info["internal_states"][0]["state"] == "serving"
    model = server.admin_ok("GET", "/get_model_info")
    assert model["is_generation"] is True and model["weight_version"] == info["weight_version"]
    loads = server.admin_ok("GET", "/v1/loads")
    assert loads["dp_rank_count"] == 1 and loads["loads"][0]["dp_rank"] == 0
    assert loads["loads"][0]["max_total_num_tokens"] > 0 and "aggregate" in loads
    assert server.admin("GET", "/v1/loads?include=nonsense").status_code == 400
    prometheus = server.admin("GET", "/v1/loads?format=prometheus").text
    assert 'sglang_num_running_reqs{dp_rank="0"} 0' in prometheus
    legacy = server.admin_ok("GET", "/get_load")
    assert legacy[0]["num_reqs"] == 0 and legacy[0]["dp_rank"] == 0


def test_cp_sglang_bodies_refuse_unknown_fields(server):
    response = server.admin("POST", "/pause_generation", json={"mode": "abort", "later": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "later"
    assert server.admin_ok("GET", "/is_paused") == {"is_paused": False}
