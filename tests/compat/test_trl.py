"""TRL's `VLLMClient` (the client of `trl vllm-serve`), its calls replayed against `trillium serve`.

`trl vllm-serve` is TRL's own FastAPI server in front of vLLM, on one port, no auth, with its
own routes (trailing slashes included); `VLLMClient` talks only to those. The calls mirror
huggingface/trl (commit f2cd5771), trl/generation/vllm_client.py (formerly
trl/extras/vllm_client.py), and the answers the server gives, trl/scripts/vllm_serve.py:

- `GET /health/` until 200 (`check_server`);
- `POST /generate/ {prompts (strings or token-id lists), images: null, n, repetition_penalty,
  temperature, top_p, top_k, min_p, max_tokens, logprobs: 0, structured_outputs_regex: null,
  generation_kwargs: {}}`; it reads `prompt_ids`, `completion_ids` (n per prompt, prompt by
  prompt), `logprobs` and `logprob_token_ids` (`[sequence][token][k]`) (`generate`);
- `POST /reset_prefix_cache/` (`reset_prefix_cache`);
- weight sync: `GET /get_world_size/` -> `world_size`, then `POST /init_communicator/ {host,
  port, world_size, client_device_uuid}`, per parameter `POST /update_named_param/ {name, dtype,
  shape}` + an NCCL broadcast, and `POST /close_communicator/` (`init_communicator`,
  `update_named_param`, `close_communicator`). The broadcast uses vLLM's
  `StatelessProcessGroup` + `PyNcclCommunicator` (CUDA only, needs vLLM in the trainer); on
  this CPU-only suite only the HTTP calls around it are replayed: the world size, and the close.

`VLLMClient` itself is not driven: its constructor raises ImportError without vLLM installed.
"""

from __future__ import annotations

import pytest

from support.replay import Replay, hf_greedy_ids

PROMPTS = [[5, 17, 99, 250], [400, 3, 77, 12, 8]]
N_TOKENS = 8


@pytest.fixture(scope="module")
def trl(server):
    client = Replay(server.base_url, "TRL VLLMClient")
    yield client
    client.close()


def generate_body(n: int, temperature: float) -> dict:
    return {"prompts": PROMPTS, "images": None, "n": n, "repetition_penalty": 1.0, "temperature": temperature,
            "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": N_TOKENS, "logprobs": 0,
            "structured_outputs_regex": None, "generation_kwargs": {}}


def test_health_and_generate(trl, root):
    trl.call("GET", "/health/")
    answer = trl.json("POST", "/generate/", json=generate_body(n=2, temperature=1.0))
    assert answer["prompt_ids"] == PROMPTS
    assert len(answer["completion_ids"]) == len(PROMPTS) * 2
    for ids, logprobs, logprob_ids in zip(answer["completion_ids"], answer["logprobs"], answer["logprob_token_ids"]):
        assert 1 <= len(ids) <= N_TOKENS and len(logprobs) == len(ids)
        assert [row[0] for row in logprob_ids] == ids and all(row[0] <= 0 for row in logprobs)
    greedy = trl.json("POST", "/generate/", json=generate_body(n=1, temperature=0.0))["completion_ids"]
    for prompt, ids in zip(PROMPTS, greedy):
        assert ids == hf_greedy_ids(root / "base", prompt, N_TOKENS)[: len(ids)]


def test_reset_prefix_cache_and_world_size(trl):
    trl.call("POST", "/reset_prefix_cache/")
    assert trl.json("GET", "/get_world_size/")["world_size"] == 1
    trl.call("POST", "/close_communicator/")


def test_generate_kwargs_text_prompts_and_top_logprobs(trl, root):
    """Text prompts come back tokenized (BOS included, as vLLM's LLM.generate tokenizes them);
    generation_kwargs override the top-level fields (TRL's dict.update); logprobs=N gives the
    sampled token and the top N, most probable first (N or N + 1 entries: extract_logprobs)."""
    from transformers import AutoTokenizer

    body = {**generate_body(n=1, temperature=0.0), "prompts": ["hello world"], "logprobs": 2,
            "generation_kwargs": {"max_tokens": 3, "seed": 7}}
    answer = trl.json("POST", "/generate/", json=body)
    assert answer["prompt_ids"] == [AutoTokenizer.from_pretrained(str(root / "base")).encode("hello world")]
    (ids,), (rows,), (row_ids,) = answer["completion_ids"], answer["logprobs"], answer["logprob_token_ids"]
    assert len(ids) <= 3 and len(rows) == len(ids)
    for token, logprobs, top in zip(ids, rows, row_ids):
        assert len(logprobs) == len(top) and len(top) in (2, 3) and token in top
        assert logprobs == sorted(logprobs, reverse=True) and top[0] == token  # greedy: the top token
    none = trl.json("POST", "/generate/", json={**generate_body(n=1, temperature=1.0), "logprobs": None})
    assert none["logprobs"] is None and none["logprob_token_ids"] is None


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_decoding_regex": "a+"}, "guided_decoding_regex"),
    ({"structured_outputs_regex": "a+"}, "structured_outputs_regex"),
    ({"generation_kwargs": {"structured_outputs": {"regex": "a+"}}}, "generation_kwargs.structured_outputs"),
    ({"generation_kwargs": {"best_of": 2}}, "generation_kwargs.best_of"),
    ({"images": [["aGk="], None]}, "images"),
])
def test_unimplemented_fields_are_400_naming_them(trl, extra, param):
    error = trl.call("POST", "/generate/", expect=400, json={**generate_body(n=1, temperature=1.0), **extra})
    assert error.json()["error"]["param"] == param, error.text


def test_nccl_communicator_is_refused_with_the_reason(trl):
    """TRL's weight sync needs vLLM's PyNcclCommunicator (CUDA); Trillium says so (400, not a
    silent success) and names its own routes for the same job."""
    init = trl.call("POST", "/init_communicator/", expect=400,
                    json={"host": "127.0.0.1", "port": 51216, "world_size": 2, "client_device_uuid": "cpu"})
    message = init.json()["error"]["message"]
    assert "PyNcclCommunicator" in message and "/init_weights_update_group" in message
    param = trl.call("POST", "/update_named_param/", expect=400,
                     json={"name": "lm_head.weight", "dtype": "torch.float32", "shape": [4, 4]})
    assert "NCCL" in param.json()["error"]["message"]
    assert trl.call("POST", "/init_communicator/", expect=400, json={"host": "x"}).json()["error"]["param"] == "port"
