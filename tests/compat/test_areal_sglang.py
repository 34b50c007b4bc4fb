"""AReaL's SGLang backend, its calls replayed against `trillium serve --admin-on-data-port`.

AReaL's remote engine sends every call to the server's address, plain aiohttp, no auth header
(`arequest_with_retry`, areal/infra/utils/http.py; `_run_request_on_all_servers`,
areal/infra/remote_inf_engine.py). The bodies mirror inclusionAI/AReaL (commit 4aef98d8),
areal/engine/sglang_remote.py:

- health: `GET /health` (`get_health_check_request`);
- rollout: `POST /generate {input_ids, image_data: null, sampling_params: {top_p, top_k,
  max_new_tokens, temperature, stop_token_ids, ignore_eos, skip_special_tokens,
  frequency_penalty}, return_logprob: true, stream: false}` (`build_generation_request`); it
  reads `meta_info.finish_reason.type`, `.get("message")`, and `[x[1]]` / `[x[0]]` of
  `meta_info.output_token_logprobs` (`parse_generation_response`); an "abort" answer is
  resubmitted after the update (`RemoteInfEngine.agenerate`);
- weight push (distributed): `POST /init_weights_update_group {master_address, master_port
  (a string), rank_offset, world_size, backend, group_name}` (`build_init_weights_group_request`),
  then `POST /pause_generation {}`, `POST /update_weights_from_distributed {names, dtypes, shapes,
  group_name, abort_all_requests: true}` while the trainer broadcasts, `POST /continue_generation
  {}` (`build_distributed_weight_update_requests`, `get_pause_request`, `get_resume_request`);
- weight push (disk): `POST /update_weights_from_disk {model_path, abort_all_requests: true}`
  between the same pause / continue (`build_disk_weight_update_requests`);
- offload / onload: `POST /release_memory_occupation {}`, `POST /resume_memory_occupation {}`
  (tags null: no body field) (`get_offload_request`, `get_onload_request`).
"""

from __future__ import annotations

import pytest

from support.replay import GroupTrainer, Replay, hf_greedy_ids, oracle_greedy
from support.serve_process import free_port

PROMPT = [7, 120, 33, 204, 65, 9]
N_TOKENS = 8
GROUP = "update_weight_group_0"


@pytest.fixture(scope="module")
def areal(server):
    client = Replay(server.base_url, "AReaL (SGLang backend)")
    yield client
    client.close()


def generation_body(greedy: bool = False) -> dict:
    return {
        "input_ids": list(PROMPT), "image_data": None,
        "sampling_params": {"top_p": 1.0, "top_k": 100000000, "max_new_tokens": N_TOKENS,
                            "temperature": 0.0 if greedy else 1.0, "stop_token_ids": [2], "ignore_eos": False,
                            "skip_special_tokens": True, "frequency_penalty": 0.0},
        "return_logprob": True, "stream": False,
    }


def parse(response: dict) -> tuple[list[int], list[float], str]:
    meta = response["meta_info"]
    reason = meta["finish_reason"]
    assert isinstance(reason.get("message", ""), str)
    pairs = meta["output_token_logprobs"]
    return [x[1] for x in pairs], [x[0] for x in pairs], reason["type"]


def test_health_and_rollout(areal):
    areal.call("GET", "/health")
    for _ in range(2):
        tokens, logprobs, reason = parse(areal.json("POST", "/generate", json=generation_body()))
        assert reason in ("stop", "length") and 1 <= len(tokens) <= N_TOKENS
        assert len(logprobs) == len(tokens) and all(lp <= 0 for lp in logprobs)
        assert reason == "length" or tokens[-1] == 2


def test_distributed_update(areal, root, tmp_path):
    assert oracle_greedy(areal, PROMPT, N_TOKENS) == hf_greedy_ids(root / "base", PROMPT, N_TOKENS)
    trainer = GroupTrainer(areal, root / "next", tmp_path)
    trainer.join({"master_address": "127.0.0.1", "master_port": str(free_port()), "rank_offset": 1,
                  "world_size": 2, "backend": "gloo", "group_name": GROUP})
    areal.call("POST", "/pause_generation", json={})
    trainer.push({"names": trainer.names, "dtypes": trainer.dtypes, "shapes": trainer.shapes,
                  "group_name": GROUP, "abort_all_requests": True})
    areal.call("POST", "/continue_generation", json={})
    assert oracle_greedy(areal, PROMPT, N_TOKENS) == hf_greedy_ids(root / "next", PROMPT, N_TOKENS)


def test_disk_update(areal, root):
    areal.call("POST", "/pause_generation", json={})
    areal.call("POST", "/update_weights_from_disk",
               json={"model_path": str(root / "base"), "abort_all_requests": True})
    areal.call("POST", "/continue_generation", json={})
    assert oracle_greedy(areal, PROMPT, N_TOKENS) == hf_greedy_ids(root / "base", PROMPT, N_TOKENS)
    tokens, _, _ = parse(areal.json("POST", "/generate", json=generation_body(greedy=True)))
    assert tokens == hf_greedy_ids(root / "base", PROMPT, N_TOKENS)[: len(tokens)]


def test_offload_onload(areal):
    areal.call("POST", "/release_memory_occupation", json={})
    areal.call("POST", "/resume_memory_occupation", json={})
    tokens, _, _ = parse(areal.json("POST", "/generate", json=generation_body()))
    assert tokens
