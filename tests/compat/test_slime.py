"""slime's calls to its SGLang server, replayed against `trillium serve --admin-on-data-port`.

slime sends generation and admin calls to one base URL (the engine's host:port), without an
admin token. Each call mirrors THUDM/slime (commit 624b824a):

- health: `GET /health_generate` with `Content-Type` and `Authorization: Bearer <api_key>`
  (`_wait_server_healthy`, slime/backends/sglang_utils/sglang_engine.py; "Bearer None" when
  no key is configured);
- rollout: `POST /generate {input_ids, sampling_params: {temperature, top_p, top_k,
  max_new_tokens, stop, stop_token_ids, skip_special_tokens, no_stop_trim: true,
  spaces_between_special_tokens: false}, return_logprob: true}`, one call per sample of a
  group; it reads `text`, `meta_info` and `meta_info.output_token_logprobs[i][0:2]`
  (`GenerateState.__init__` and `generate`, slime/rollout/sglang_rollout.py);
- abort: `POST /abort_request {abort_all: true}` then `GET /v1/loads?include=core` until the
  request count (num_reqs / num_running_reqs + num_waiting_reqs, possibly under "loads") is 0
  (slime/backends/sglang_utils/server_control.py);
- weight push (distributed): once `POST /init_weights_update_group {master_address,
  master_port, rank_offset, world_size, group_name, backend}`, then per update
  `POST /pause_generation {}`, `GET /flush_cache`, `POST /update_weights_from_distributed
  {names, dtypes ("float32"), shapes, group_name, flush_cache: false, weight_version: "1"}`
  while the trainer broadcasts, `POST /continue_generation {}`; `GET /get_weight_version`
  reads `weight_version`; at the end `POST /destroy_weights_update_group {group_name}`
  (`UpdateWeightFromDistributed.update_weights`, `connect_rollout_engines_from_distributed`,
  `update_weights_from_distributed` in
  slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py, and the
  SGLangEngine methods of the same names);
- colocated offload / onload: `GET /flush_cache`, `POST /release_memory_occupation {}`,
  `POST /resume_memory_occupation {tags: ["weights"]}` then `{tags: ["kv_cache"]}`
  (`release_memory_occupation` / `resume_memory_occupation`, sglang_engine.py).
"""

from __future__ import annotations

import concurrent.futures

import pytest

from support.replay import GroupTrainer, Replay, hf_greedy_ids, oracle_greedy
from support.serve_process import free_port

PROMPT = [5, 17, 99, 250, 31, 400, 3]
N_TOKENS = 8
GROUP = "slime-pp_0"


@pytest.fixture(scope="module")
def slime(server):
    client = Replay(server.base_url, "slime")
    yield client
    client.close()


def rollout_body(**sampling) -> dict:
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": N_TOKENS, "stop": None,
              "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
              "spaces_between_special_tokens": False, **sampling}
    return {"sampling_params": params, "return_logprob": True, "input_ids": list(PROMPT)}


def num_requests(load) -> int:
    """slime's reading of a /v1/loads answer (server_control.num_requests_from_load)."""
    if isinstance(load, list):
        return sum(num_requests(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return num_requests(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return load[key]
    running = load.get("num_running_reqs", load.get("total_running_reqs"))
    waiting = load.get("num_waiting_reqs", load.get("total_waiting_reqs"))
    return (running if isinstance(running, int) else 0) + (waiting if isinstance(waiting, int) else 0)


def test_health_then_group_rollout(slime):
    slime.call("GET", "/health_generate",
               headers={"Content-Type": "application/json; charset=utf-8", "Authorization": "Bearer None"})
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        outputs = list(pool.map(lambda _: slime.json("POST", "/generate", json=rollout_body()), range(4)))
    for output in outputs:
        pairs = output["meta_info"]["output_token_logprobs"]
        tokens, logprobs = [p[1] for p in pairs], [p[0] for p in pairs]
        assert 1 <= len(tokens) <= N_TOKENS and all(isinstance(t, int) for t in tokens)
        assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs)
        assert isinstance(output["text"], str)
        assert output["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        assert output["meta_info"]["completion_tokens"] == len(tokens)


def test_abort_until_idle(slime):
    slime.call("POST", "/abort_request", json={"abort_all": True})
    load = slime.json("GET", "/v1/loads", params={"include": "core"})
    assert num_requests(load) == 0, load


def test_distributed_weight_update_cycle(slime, root, tmp_path):
    assert oracle_greedy(slime, PROMPT, N_TOKENS) == hf_greedy_ids(root / "base", PROMPT, N_TOKENS)
    trainer = GroupTrainer(slime, root / "next", tmp_path)
    trainer.join({"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
                  "group_name": GROUP, "backend": "gloo"})
    slime.call("POST", "/pause_generation", json={})
    slime.call("GET", "/flush_cache")
    trainer.push({"names": trainer.names, "dtypes": trainer.dtypes, "shapes": trainer.shapes,
                  "group_name": GROUP, "flush_cache": False, "weight_version": "1"})
    slime.call("POST", "/continue_generation", json={})
    assert slime.json("GET", "/get_weight_version")["weight_version"] == "1"
    assert oracle_greedy(slime, PROMPT, N_TOKENS) == hf_greedy_ids(root / "next", PROMPT, N_TOKENS)
    output = slime.json("POST", "/generate", json=rollout_body())
    assert output["meta_info"]["weight_version"] == "1"
    slime.call("POST", "/destroy_weights_update_group", json={"group_name": GROUP})


def test_colocated_offload_onload(slime):
    slime.call("GET", "/flush_cache")
    slime.call("POST", "/release_memory_occupation", json={})
    slime.call("POST", "/resume_memory_occupation", json={"tags": ["weights"]})
    slime.call("POST", "/resume_memory_occupation", json={"tags": ["kv_cache"]})
    output = slime.json("POST", "/generate", json=rollout_body(temperature=0.0))
    assert len(output["meta_info"]["output_token_logprobs"]) >= 1
