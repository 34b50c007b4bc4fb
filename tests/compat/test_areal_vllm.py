"""AReaL's vLLM backend, its calls replayed against `trillium serve --admin-on-data-port`.

AReaL talks to vLLM's OpenAI server plus its own `/areal_*` routes (areal_vllm_server.py), all on
the server's one address, plain aiohttp, no auth header (`arequest_with_retry`,
areal/infra/utils/http.py). The bodies mirror inclusionAI/AReaL (commit 4aef98d8),
areal/engine/vllm_remote.py:

- health: `GET /health` (`get_health_check_request`);
- rollout: `POST /v1/completions {prompt: token ids, top_p, top_k, max_tokens, temperature,
  stop_token_ids, ignore_eos, skip_special_tokens, return_tokens_as_token_ids: true,
  logprobs: 0, use_beam_search: false, stream: false}`, no `model` field
  (`build_generation_request`); it reads `choices[0].finish_reason` and
  `choices[0].logprobs.tokens` as `"token_id:N"` (split on ":") with
  `choices[0].logprobs.token_logprobs` (`parse_generation_response`);
- weight push (disk): `POST /areal_pause_generation {}`, `POST /areal_update_weights
  {model_path}`, `POST /areal_continue_generation {}` (`get_pause_request`,
  `build_disk_weight_update_requests`, `get_resume_request`; the routes and their
  `{success, message}` answers: areal/engine/vllm_ext/areal_vllm_server.py);
- weight push (xccl): `POST /areal_init_weights_update_group {master_address, master_port (a
  string), rank_offset, world_size, backend, group_name}` once, then per update the pause,
  `POST /areal_set_update_weight_meta {names, dtypes, shapes, group_name}` and
  `POST /areal_update_weights_xccl {}` while the trainer broadcasts, and the continue
  (`build_init_weights_group_request`, `build_distributed_weight_update_requests`);
- offload / onload: `POST /sleep` (no query: level 1) and `POST /wake_up?tags=weights&tags=kv_cache`
  (`get_offload_request`, `get_onload_request`).
"""

from __future__ import annotations

import pytest

from support.replay import GroupTrainer, Replay, hf_greedy_ids, oracle_greedy
from support.serve_process import free_port

PROMPT = [11, 230, 5, 77, 102, 8]
N_TOKENS = 8
GROUP = "areal-vllm-update"


@pytest.fixture(scope="module")
def areal(server):
    client = Replay(server.base_url, "AReaL (vLLM backend)")
    yield client
    client.close()


def completion_body(greedy: bool = False) -> dict:
    return {"top_p": 1.0, "top_k": 100000000, "max_tokens": N_TOKENS, "temperature": 0.0 if greedy else 1.0,
            "stop_token_ids": [2], "ignore_eos": False, "skip_special_tokens": True,
            "return_tokens_as_token_ids": True, "logprobs": 0, "use_beam_search": False, "stream": False,
            "prompt": list(PROMPT)}


def parse(response: dict) -> tuple[list[int], list[float], str]:
    choice = response["choices"][0]
    tokens = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    return tokens, choice["logprobs"]["token_logprobs"], choice["finish_reason"]


def test_health_and_rollout(areal, root):
    areal.call("GET", "/health")
    tokens, logprobs, reason = parse(areal.json("POST", "/v1/completions", json=completion_body()))
    assert reason in ("stop", "length") and 1 <= len(tokens) <= N_TOKENS
    assert len(logprobs) == len(tokens) and all(lp <= 0 for lp in logprobs)
    tokens, _, _ = parse(areal.json("POST", "/v1/completions", json=completion_body(greedy=True)))
    assert tokens == hf_greedy_ids(root / "base", PROMPT, N_TOKENS)[: len(tokens)]


def test_distributed_update(areal, root, tmp_path):
    """AReaL's xccl push to its vLLM server: /areal_init_weights_update_group (master_port a
    string), then per update pause, /areal_set_update_weight_meta, /areal_update_weights_xccl
    while the trainer broadcasts, continue (`build_init_weights_group_request`,
    `build_distributed_weight_update_requests`). Pushes whichever checkpoint is not served."""
    served_base = oracle_greedy(areal, PROMPT, N_TOKENS) == hf_greedy_ids(root / "base", PROMPT, N_TOKENS)
    pushed = root / ("next" if served_base else "base")
    trainer = GroupTrainer(areal, pushed, tmp_path)
    answer = trainer.join({"master_address": "127.0.0.1", "master_port": str(free_port()), "rank_offset": 1,
                           "world_size": 2, "backend": "gloo", "group_name": GROUP},
                          path="/areal_init_weights_update_group")
    assert answer["success"] is True, answer
    areal.json("POST", "/areal_pause_generation", json={})
    meta = {"names": trainer.names, "dtypes": trainer.dtypes, "shapes": trainer.shapes, "group_name": GROUP}
    assert areal.json("POST", "/areal_set_update_weight_meta", json=meta)["success"] is True
    assert trainer.push({}, path="/areal_update_weights_xccl")["success"] is True
    areal.json("POST", "/areal_continue_generation", json={})
    assert oracle_greedy(areal, PROMPT, N_TOKENS) == hf_greedy_ids(pushed, PROMPT, N_TOKENS)


def test_areal_bodies_are_checked(areal, root):
    """Fields AReaL does not send are refused, not ignored; an update before any meta is a 400."""
    refused = areal.call("POST", "/areal_update_weights", expect=400,
                         json={"model_path": str(root / "next"), "load_format": "dummy"})
    assert refused.json()["success"] is False and refused.json()["error"]["param"] == "load_format"
    extra = areal.call("POST", "/areal_pause_generation", expect=400, json={"mode": "retract"}).json()
    assert extra["error"]["param"] == "mode"


def test_disk_update(areal, root):
    areal.json("POST", "/areal_pause_generation", json={})
    answer = areal.json("POST", "/areal_update_weights", json={"model_path": str(root / "next")})
    assert answer["success"] is True, answer
    areal.json("POST", "/areal_continue_generation", json={})
    assert oracle_greedy(areal, PROMPT, N_TOKENS) == hf_greedy_ids(root / "next", PROMPT, N_TOKENS)


def test_sleep_and_wake_with_tags(areal):
    areal.call("POST", "/sleep", json={})
    areal.call("POST", "/wake_up?tags=weights&tags=kv_cache", json={})
    tokens, _, _ = parse(areal.json("POST", "/v1/completions", json=completion_body()))
    assert tokens
