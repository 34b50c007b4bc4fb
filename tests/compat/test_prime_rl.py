"""prime-rl's orchestrator, its calls replayed against `trillium serve --admin-on-data-port`.

prime-rl's admin clients use the inference `base_url` (with "/v1" stripped) unless
`admin_base_url` is set, and send `Authorization: Bearer <api key>` when the key is not
"EMPTY" (`setup_admin_clients`, src/prime_rl/utils/client.py). Here that key is the admin
token (Trillium's data plane has no key, so the one header opens both). The calls mirror
PrimeIntellect-ai/prime-rl (commit 559b4477):

- `GET /health` (`check_health`) and `GET /v1/models`, looking for the model in `data[].id`
  (`maybe_check_has_model`), src/prime_rl/utils/client.py;
- rollout: `POST /v1/chat/completions {model, messages, temperature, top_p: 1.0, logprobs: true,
  max_completion_tokens, cache_salt}` -- the sampling args of `TrainSamplingConfig.to_sampling_args`
  (packages/prime-rl-configs/src/prime_rl/configs/orchestrator.py) with `extra_body.cache_salt`
  per weight version (`_sampling`, src/prime_rl/orchestrator/envs.py), sent through the OpenAI
  client, which merges extra_body into the body; the trainer reads the per-token
  `choices[0].logprobs.content[].logprob`;
- weight update: `POST /pause?mode=keep&clear_cache=false`, `POST /update_weights {weight_dir}`,
  `POST /resume` (`_pause_engines`, `update_weights`, `_resume_engines`, client.py; the
  server's `/update_weights` loads `weight_dir` from the filesystem:
  src/prime_rl/inference/vllm/server.py).
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from support.replay import Replay, hf_greedy_ids, oracle_greedy
from support.waiting import wait_until

TOKEN = "prime-rl-admin-token"
N_TOKENS = 8
INFLIGHT_TOKENS = 160  # long enough to be caught mid-generation by the pause
MESSAGES = [{"role": "user", "content": "Count to five."}]
SERVE_ENV = {"TRILLIUM_ADMIN_TOKEN": TOKEN}  # the client sends it as its API key (conftest.py)


@pytest.fixture(scope="module")
def prime(server):
    client = Replay(server.base_url, "prime-rl", headers={"Authorization": f"Bearer {TOKEN}"})
    yield client
    client.close()


def chat_body(salt: str, max_tokens: int = N_TOKENS) -> dict:
    return {"model": "test-model", "messages": MESSAGES, "temperature": 1.0, "top_p": 1.0, "logprobs": True,
            "max_completion_tokens": max_tokens, "cache_salt": salt}


def num_running(prime) -> int:
    """The engine's running requests (SGLang's /v1/loads; a harness probe, not a prime-rl call)."""
    return prime.json("GET", "/v1/loads")["aggregate"]["total_running_reqs"]


def pause_with_request_in_flight(prime, pool):
    """A long rollout in flight, then prime-rl's pause; the rollout's future once the pause froze it.

    WHY retry: on a fast engine the rollout may finish before the pause lands; then nothing
    was in flight across it and the cycle is tried again."""
    for _ in range(5):
        inflight = pool.submit(prime.json, "POST", "/v1/chat/completions",
                               json=chat_body("step-0", max_tokens=INFLIGHT_TOKENS))
        wait_until(lambda: inflight.done() or num_running(prime) >= 1, timeout_s=60, interval_s=0.01,
                   what="the rollout to be running")
        prime.call("POST", "/pause", params={"mode": "keep", "clear_cache": "false"})
        time.sleep(0.5)  # a request that was not frozen would be answered by now
        if not inflight.done():
            return inflight
        prime.call("POST", "/resume")
    pytest.fail("every rollout finished before the pause landed")


def test_health_models_rollout(prime):
    prime.call("GET", "/health")
    assert any(model["id"] == "test-model" for model in prime.json("GET", "/v1/models")["data"])
    answer = prime.json("POST", "/v1/chat/completions", json=chat_body("step-0"))
    choice = answer["choices"][0]
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert 1 <= len(logprobs) <= N_TOKENS and all(lp <= 0 for lp in logprobs)
    assert answer["usage"]["completion_tokens"] == len(logprobs)


def test_update_weights_keeps_inflight_requests(prime, root):
    prompt = [3, 14, 15, 92, 65]
    assert oracle_greedy(prime, prompt, N_TOKENS) == hf_greedy_ids(root / "base", prompt, N_TOKENS)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        inflight = pause_with_request_in_flight(prime, pool)
        try:
            (root / "next" / "NCCL_READY").touch()  # as update_weights does before the POST
            prime.call("POST", "/update_weights", json={"weight_dir": str(root / "next")})
        finally:  # as prime-rl's update_weights: a dropped /resume would leave the engine paused
            prime.call("POST", "/resume")
        # mode=keep: a request in flight across the pause finishes, it is not aborted.
        assert inflight.result(timeout=120)["choices"][0]["finish_reason"] in ("stop", "length")
    assert oracle_greedy(prime, prompt, N_TOKENS) == hf_greedy_ids(root / "next", prompt, N_TOKENS)
    assert prime.json("POST", "/v1/chat/completions", json=chat_body("step-1"))["choices"][0]["logprobs"]
