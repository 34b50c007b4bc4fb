"""Which requests are final-only (SamplingParams.final_only): every route's unstreamed responses,
none of its streamed ones, on the in-process data-plane harness.

A final-only request's tokens are held by the scheduler in chunks (tests/actors/scheduler/
test_loop.py); what a response holds is the same either way (tests/data_plane/test_dp_multi_step.py).
This checks the routes ask for it: the engine client's `generate` is wrapped to record each
request's flag. vLLM's LLM asks FINAL_ONLY for its offline requests and its servers stream with
DELTA (vllm/sampling_params.py RequestOutputKind); SGLang streams only `stream: true` requests.
A chat reply whose thinking is split out (--reasoning-parser) is not final-only: its
`reasoning_tokens` are found by decoding the delta where the thinking ends (chat_reply.py), which
stays a chunk of tokens rather than a whole reply.
"""

from __future__ import annotations

import httpx
import pytest

from support.data_plane_server import MODEL_NAME

PROMPT = [5, 6, 7]
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def flags(dp_server, monkeypatch) -> list[bool]:
    seen: list[bool] = []
    generate = dp_server.client.generate

    async def recording(request_id, prompt_token_ids, params, *args, **kwargs):
        seen.append(params.final_only)
        return await generate(request_id, prompt_token_ids, params, *args, **kwargs)

    monkeypatch.setattr(dp_server.client, "generate", recording)
    return seen


def _post(dp_server, path: str, body: dict, app: str = "default") -> None:
    with httpx.Client(base_url=dp_server.url(app), timeout=60) as http:
        if body.get("stream"):
            with http.stream("POST", path, json=body) as response:
                assert response.status_code == 200
                response.read()
        else:
            response = http.post(path, json=body)
            assert response.status_code == 200, response.text


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
def test_unstreamed_responses_are_final_only_and_streamed_ones_are_not(dp_server, flags, stream):
    few = {"max_tokens": 4, "temperature": 0, "stream": stream}
    _post(dp_server, "/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, **few})
    _post(dp_server, "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, **few})
    _post(dp_server, "/v1/messages", {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4,
                                      "stream": stream})
    _post(dp_server, "/v1/responses", {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 4,
                                       "stream": stream})
    _post(dp_server, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}, "stream": stream})
    assert flags == [not stream] * 5


def test_trl_generate_is_final_only_and_a_split_thinking_reply_is_not(dp_server, flags):
    _post(dp_server, "/generate/", {"prompts": [PROMPT], "max_tokens": 4})
    _post(dp_server, "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4},
          app="reasoning")
    assert flags == [True, False]
