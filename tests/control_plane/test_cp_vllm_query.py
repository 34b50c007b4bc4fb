"""vLLM's query-string admin calls against a real `trillium serve`.

vLLM takes these arguments in the query, not the body; each call here is the
one vLLM's own routes define:
  - vllm-project/vllm vllm/entrypoints/serve/dev/rlhf/api_router.py:
    POST /pause?mode=abort|wait|keep&wait_for_inflight_requests=&clear_cache=, POST /resume
  - vllm-project/vllm vllm/entrypoints/openai/api_server.py (and serve/dev/sleep/api_router.py):
    POST /sleep?level=&mode=, POST /wake_up?tags=weights&tags=kv_cache (repeatable)
  - vllm-project/vllm vllm/entrypoints/serve/cache/api_router.py:
    POST /reset_prefix_cache?reset_running_requests=&reset_external=
They mean what they mean in vLLM (/pause?mode=keep keeps the stream in
flight); a query parameter a route does not take is a 400 naming it.
"""

from __future__ import annotations

import pytest

from support.admin_server import MAX_TOKENS, PROMPTS, final_reason, start_stream


def test_cp_query_pause_keep_keeps_requests(server, restore_base):
    thread, result = start_stream(server, 240)  # long enough that the pause lands mid-stream on a loaded box
    reply = server.admin_ok("POST", "/pause?mode=keep")
    assert reply["state"] == "paused" and reply["mode"] == "keep"
    assert server.admin_ok("GET", "/is_paused") == {"is_paused": True}
    thread.join(1.0)
    assert thread.is_alive()  # frozen, not aborted
    server.admin_ok("POST", "/resume")
    thread.join(60)
    assert result["status"] == 200 and final_reason(result) == "length"


def test_cp_query_pause_wait_for_inflight(server, restore_base):
    thread, result = start_stream(server, 40)
    reply = server.admin_ok("POST", "/pause?wait_for_inflight_requests=true&clear_cache=true")
    assert reply["mode"] == "wait" and reply["cache_cleared"] is True
    thread.join(60)
    assert final_reason(result) == "length"  # it finished before the pause took hold
    server.admin_ok("POST", "/resume")


def test_cp_query_sleep_level_and_wake_tags(server, references, restore_base):
    reply = server.admin_ok("POST", "/sleep?level=1&mode=abort")
    assert reply["level"] == 1 and server.admin_ok("GET", "/is_sleeping") == {"is_sleeping": True}
    assert server.admin_ok("POST", "/wake_up?tags=weights")["tags"] == ["weights"]
    assert server.admin_ok("GET", "/is_sleeping") == {"is_sleeping": True}  # the KV cache still sleeps
    assert server.admin_ok("POST", "/wake_up?tags=kv_cache&tags=weights")["tags"] == ["kv_cache", "weights"]
    assert server.admin_ok("GET", "/is_sleeping") == {"is_sleeping": False}
    assert server.greedy(PROMPTS, MAX_TOKENS) == references["base"]


def test_cp_query_sleep_level_2_discards_weights(server, weights_root, references, restore_base):
    server.admin_ok("POST", "/sleep?level=2")
    assert server.admin("POST", "/wake_up").status_code == 409  # level 2: weights must be loaded first
    server.admin_ok("POST", "/update_weights_from_disk", json={"model_path": str(weights_root / "base")})
    server.admin_ok("POST", "/wake_up")
    assert server.greedy(PROMPTS, MAX_TOKENS) == references["base"]


def test_cp_query_reset_prefix_cache(server):
    assert server.admin_ok("POST", "/reset_prefix_cache?reset_external=true")["success"]
    refused = server.admin("POST", "/reset_prefix_cache?reset_running_requests=true")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reset_running_requests"


@pytest.mark.parametrize("method, path, param", [
    ("POST", "/sleep?lvl=2", "lvl"),
    ("POST", "/wake_up?tag=weights", "tag"),
    ("POST", "/pause?mode=keep&later=1", "later"),
    ("POST", "/resume?now=1", "now"),
    ("GET", "/is_sleeping?x=1", "x"),
    ("POST", "/update_weights_from_tensor?version=v9", "version"),
    ("POST", "/sleep?level=two", "level"),
    ("POST", "/sleep?level=3", "level"),
    ("POST", "/pause?mode=later", "mode"),
    ("POST", "/wake_up?tags=gpu", "tags"),
])
def test_cp_bad_query_is_400(server, method, path, param):
    response = server.admin(method, path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert server.admin_ok("GET", "/is_sleeping") == {"is_sleeping": False}  # nothing happened


def test_cp_query_and_body_disagree(server):
    response = server.admin("POST", "/sleep?level=2", json={"level": 1})
    assert response.status_code == 400 and "give it once" in response.json()["error"]["message"]
