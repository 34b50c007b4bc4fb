"""verl's SGLang HTTP adapter, its calls replayed against `trillium serve --admin-on-data-port`.

verl's `HttpServerAdapter` / `AsyncHttpServerAdapter` post to `http://host:port/<endpoint>` with
`json=payload or {}` and no auth header, except the start-up health loop, which sends
`Authorization: Bearer <api_key>` ("Bearer None" without a key). The calls mirror
volcengine/verl (commit b178a3cd), verl/workers/rollout/sglang_rollout/http_server_engine.py
unless said otherwise:

- start-up: `GET /health_generate` then `GET /flush_cache` until 200 (`launch_server_process`);
- rollout: `POST /generate` with the None-valued fields dropped: `{sampling_params, input_ids,
  return_logprob}` (`AsyncHttpServerAdapter.generate`; the sampling fields and
  `max_new_tokens` as `async_sglang_server.py` builds them); verl reads
  `meta_info.output_token_logprobs` as `(logprob, token_id, _)` and `output_ids`
  (`SGLangHttpServer.generate`, verl/workers/rollout/sglang_rollout/async_sglang_server.py);
- sleep / wake in hybrid mode: `POST /release_memory_occupation {tags: ["kv_cache", "weights"]}`,
  `POST /resume_memory_occupation {tags: ["weights"]}`, the weight update, `GET /flush_cache`,
  `POST /resume_memory_occupation {tags: ["kv_cache"]}` (`ServerAdapter.release`, `resume`,
  `update_weights`, verl/workers/rollout/sglang_rollout/sglang_rollout.py);
- weight update: `POST /update_weights_from_tensor {serialized_named_tensors: [base64 of a
  pickle], load_format, flush_cache}` (`update_weights_from_tensor`): Trillium never unpickles,
  so this is the 400 that says what to send instead; the push then goes the way it names: the
  same route with the raw bytes of a safetensors file (`application/octet-stream`,
  `flush_cache` in the query);
- abort: `POST /abort_request {rid: "", abort_all: true}` (`abort_request`).
"""

from __future__ import annotations

import base64
import io
import pickle

import pytest
import torch

from support.replay import Replay, hf_greedy_ids, oracle_greedy

PROMPT = [19, 402, 56, 7, 300, 61, 12]
N_TOKENS = 8


@pytest.fixture(scope="module")
def verl(server):
    client = Replay(server.base_url, "verl (SGLang HTTP adapter)")
    yield client
    client.close()


def generate_body(greedy: bool = False) -> dict:
    sampling = {"temperature": 0.0 if greedy else 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
                "max_new_tokens": N_TOKENS}
    return {"sampling_params": sampling, "input_ids": list(PROMPT), "return_logprob": True}


def pickled_tensors() -> str:
    """What verl sends: base64 of a pickled list of (name, tensor) (here a plain pickle of CPU tensors)."""
    buffer = io.BytesIO()
    pickle.dump([("lm_head.weight", torch.zeros(2, 2))], buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_startup_and_rollout(verl, root):
    verl.call("GET", "/health_generate",
              headers={"Content-Type": "application/json; charset=utf-8", "Authorization": "Bearer None"})
    verl.call("GET", "/flush_cache",
              headers={"Content-Type": "application/json; charset=utf-8", "Authorization": "Bearer None"})
    output = verl.json("POST", "/generate", json=generate_body())
    log_probs, token_ids = zip(*[(lp, tid) for lp, tid, _ in output["meta_info"]["output_token_logprobs"]])
    assert list(token_ids) == output["output_ids"] and all(lp <= 0 for lp in log_probs)
    greedy = verl.json("POST", "/generate", json=generate_body(greedy=True))["output_ids"]
    assert greedy == hf_greedy_ids(root / "base", PROMPT, N_TOKENS)[: len(greedy)]


def test_sleep_update_wake_cycle(verl, root):
    verl.call("POST", "/release_memory_occupation", json={"tags": ["kv_cache", "weights"]})
    verl.call("POST", "/resume_memory_occupation", json={"tags": ["weights"]})
    refused = verl.call("POST", "/update_weights_from_tensor", expect=400,
                        json={"serialized_named_tensors": [pickled_tensors()], "load_format": None,
                              "flush_cache": False})
    message = refused.text.lower()
    assert "unpickle" in message and "safetensors" in message, refused.text
    body = (root / "next" / "model.safetensors").read_bytes()
    verl.call("POST", "/update_weights_from_tensor", params={"flush_cache": "false"}, content=body,
              headers={"Content-Type": "application/octet-stream"})
    verl.call("GET", "/flush_cache")
    verl.call("POST", "/resume_memory_occupation", json={"tags": ["kv_cache"]})
    assert oracle_greedy(verl, PROMPT, N_TOKENS) == hf_greedy_ids(root / "next", PROMPT, N_TOKENS)


def test_abort_all(verl):
    verl.call("POST", "/abort_request", json={"rid": "", "abort_all": True})
    assert verl.json("POST", "/generate", json=generate_body())["output_ids"]
