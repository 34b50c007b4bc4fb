"""vLLM's rollout fields on a real `trillium serve`, through the openai SDK and raw httpx.

Each field's name, type, default and response shape mirror vLLM's own code
(vllm-project/vllm; in older trees these were vllm/entrypoints/openai/
protocol.py, serving_completion.py and serving_chat.py):
vllm/entrypoints/openai/completion/protocol.py and chat_completion/protocol.py
(the request fields, `CompletionResponseChoice.prompt_token_ids / token_ids /
prompt_logprobs`, `ChatCompletionResponse.prompt_token_ids / prompt_logprobs`,
`check_generation_prompt`), completion/serving.py and chat_completion/
serving.py (prompt ids on a stream's first chunk, token ids on every chunk,
`"cmpl-" + _base_request_id(...)`, `_create_*_logprobs` with
`return_as_token_id`), vllm/entrypoints/generate/base/serving.py
(`format_token_id_placeholder`: "token_id:N"), vllm/sampling_params.py
(`update_from_tokenizer`: bad words as given and with a leading space) and
vllm/entrypoints/openai/server_utils.py (XRequestIdMiddleware). The
oracles: the tokenizer for token ids, HF transformers for prompt logprobs.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from support.oracles import transformers_model
from support.serve_process import ServeProcess
from trillium.models.tokenizer import load_tokenizer

MODEL = "test-model"
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def model_path(checkpoint):
    return str(checkpoint("llama"))


@pytest.fixture(scope="module")
def server(model_path):
    proc = ServeProcess(model_path, "--max-num-seqs", "16", "--kv-cache-memory", "16MiB").wait_healthy()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def tok(model_path):
    return load_tokenizer(model_path)


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": MODEL, **body}, headers=headers, timeout=60)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def chat_prompt_ids(tok, messages, **kwargs) -> list[int]:
    text = tok.hf.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True, **kwargs})
    return tok.encode(text, add_special_tokens=False)


# --- return_token_ids ------------------------------------------------------


def test_completion_token_ids_are_the_tokenizers_streamed_too(sdk, tok):
    body = dict(model=MODEL, prompt=PROMPT, **GREEDY)
    extra = {"return_token_ids": True, "ignore_eos": True}
    choice = sdk.completions.create(**body, extra_body=extra).choices[0].model_dump()
    assert choice["prompt_token_ids"] == tok.encode(PROMPT)
    assert len(choice["token_ids"]) == GREEDY["max_tokens"]
    assert tok.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]

    chunks = [c.choices[0].model_dump() for c in sdk.completions.create(**body, extra_body=extra, stream=True)
              if c.choices]
    assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]

    plain = sdk.completions.create(**body).choices[0].model_dump()
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None


def test_chat_token_ids_streamed_and_not(sdk, tok):
    extra = {"return_token_ids": True, "ignore_eos": True}
    full = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=extra, **GREEDY).model_dump()
    assert full["prompt_token_ids"] == chat_prompt_ids(tok, MESSAGES)
    ids = full["choices"][0]["token_ids"]
    assert len(ids) == full["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    assert tok.decode(ids, skip_special_tokens=True) == full["choices"][0]["message"]["content"]

    chunks = [c.model_dump() for c in sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, extra_body=extra, stream=True, **GREEDY)]
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert [t for c in chunks[1:] for ch in c["choices"] for t in ch["token_ids"]] == ids


def test_tokens_as_token_ids_in_both_logprob_formats(sdk, tok):
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
    choice = sdk.completions.create(model=MODEL, prompt=PROMPT, logprobs=2, extra_body=extra,
                                    **GREEDY).choices[0].model_dump()
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for k in top)

    chat = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2,
                                       extra_body=extra, **GREEDY).model_dump()
    ids = chat["choices"][0]["token_ids"]
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in ids]
    # vLLM keeps the sampled token's decoded bytes, and the placeholder's in top_logprobs.
    assert [c["bytes"] for c in content] == [list(tok.decode([t]).encode()) for t in ids]
    assert all(top["token"].startswith("token_id:") for c in content for top in c["top_logprobs"])


# --- prompt_logprobs ---------------------------------------------------------


def test_prompt_logprobs_match_echo_and_transformers(server, sdk, tok, model_path):
    prompt_ids = tok.encode(PROMPT)
    choice = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                    extra_body={"prompt_logprobs": 3}).choices[0].model_dump()
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    echo = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True,
                                  logprobs=3).choices[0].logprobs
    hf = transformers_model(model_path)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt_ids])).logits[0].log_softmax(-1)
    for k in range(1, len(prompt_ids)):
        own = entries[k][str(prompt_ids[k])]
        assert own["logprob"] == pytest.approx(echo.token_logprobs[k], abs=1e-6)
        assert own["logprob"] == pytest.approx(expected[k - 1, prompt_ids[k]].item(), abs=2e-3)
        assert own["decoded_token"] == tok.decode([prompt_ids[k]])
        # The prompt's own token and the top 3 (ranks 1..3), as vLLM's dicts.
        assert sorted(e["rank"] for e in entries[k].values()) == sorted({1, 2, 3, own["rank"]})
        best = next(e for e in entries[k].values() if e["rank"] == 1)
        assert best["logprob"] == pytest.approx(expected[k - 1].max().item(), abs=2e-3)

    chat = ok(post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                                     "prompt_logprobs": 0, "return_token_ids": True}))
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"]) and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])  # 0: the prompt's own token only


# --- allowed_token_ids, bad_words ----------------------------------------------


def test_allowed_token_ids_restrict_every_sampled_token(server):
    allowed = list(range(100, 110))
    body = {"n": 4, "seed": 3, "temperature": 1.0, "max_tokens": 16, "ignore_eos": True,
            "allowed_token_ids": allowed, "return_token_ids": True}
    result = ok(post(server, "/v1/completions", {**body, "prompt": PROMPT}))
    sampled = [t for c in result["choices"] for t in c["token_ids"]]
    assert len(sampled) == 64 and set(sampled) <= set(allowed)
    chat = ok(post(server, "/v1/chat/completions", {**body, "messages": MESSAGES}))
    assert {t for c in chat["choices"] for t in c["token_ids"]} <= set(allowed)


def test_bad_words_never_appear(server, tok):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    baseline = ok(post(server, "/v1/completions", body))["choices"][0]["token_ids"]

    def single_token_word(token_id: int) -> str | None:
        word = tok.decode([token_id]).strip()
        forms = (tok.encode(word, add_special_tokens=False), tok.encode(" " + word, add_special_tokens=False))
        return word if word and [token_id] in forms else None

    token_id, word = next((t, w) for t in baseline if (w := single_token_word(t)))
    banned = ok(post(server, "/v1/completions", {**body, "bad_words": [word]}))["choices"][0]["token_ids"]
    assert token_id not in banned and banned != baseline
    assert len(banned) == 12


# --- truncate_prompt_tokens, add_special_tokens ------------------------------------


def test_truncation_keeps_the_last_n_tokens(server, tok):
    ids = list(range(10, 50))
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    cut = ok(post(server, "/v1/completions", {**body, "prompt": ids, "truncate_prompt_tokens": 8}))
    direct = ok(post(server, "/v1/completions", {**body, "prompt": ids[-8:]}))
    assert cut["choices"][0]["prompt_token_ids"] == ids[-8:] and cut["usage"]["prompt_tokens"] == 8
    assert cut["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
    right = ok(post(server, "/v1/completions", {**body, "prompt": ids, "truncate_prompt_tokens": 8,
                                                "truncation_side": "right"}))
    assert right["choices"][0]["prompt_token_ids"] == ids[:8]
    whole = ok(post(server, "/v1/completions", {**body, "prompt": ids, "truncate_prompt_tokens": -1}))
    assert whole["choices"][0]["prompt_token_ids"] == ids
    chat = ok(post(server, "/v1/chat/completions", {**body, "messages": MESSAGES, "truncate_prompt_tokens": 5}))
    assert chat["prompt_token_ids"] == chat_prompt_ids(tok, MESSAGES)[-5:]

    no_bos = ok(post(server, "/v1/completions", {**body, "prompt": PROMPT, "add_special_tokens": False}))
    assert no_bos["choices"][0]["prompt_token_ids"] == tok.encode(PROMPT, add_special_tokens=False)
    assert tok.encode(PROMPT, add_special_tokens=False) != tok.encode(PROMPT)  # the checkpoint adds BOS


# --- cache_salt, cached_tokens -----------------------------------------------------


def test_cache_salt_separates_prefix_cache_and_cached_tokens_count_it(server, sdk):
    prompt = [(7 * i) % 400 + 20 for i in range(70)]  # 4 full blocks of 16 tokens, then 6

    def cached(**extra) -> int:
        result = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra or None)
        return result.usage.prompt_tokens_details.cached_tokens

    assert cached() == 0
    assert cached() == 64
    assert cached(cache_salt="alice") == 0
    assert cached(cache_salt="alice") == 64
    assert cached(cache_salt="bob") == 0
    chunks = list(sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=1, stream=True,
                                         stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 64
    messages = [{"role": "user", "content": "the salted cache test " * 12}]
    sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    again = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert again.prompt_tokens_details.cached_tokens == (again.prompt_tokens - 1) // 16 * 16 > 0


# --- request ids ----------------------------------------------------------------------


def test_request_id_from_header_or_body_and_echoed(server, sdk):
    raw = sdk.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                                   extra_body={"request_id": "body-1"})
    assert raw.parse().id == "cmpl-body-1" and raw.headers["X-Request-Id"] == "body-1"
    raw = sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"request_id": "body-1"},
        extra_headers={"X-Request-Id": "hdr-2"})
    assert raw.parse().id == "chatcmpl-hdr-2" and raw.headers["X-Request-Id"] == "hdr-2"
    fresh = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert ok(fresh)["id"] == "cmpl-" + fresh.headers["X-Request-Id"]

    # Clients reuse ids; two requests in flight with one id both complete.
    body = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: post(server, "/v1/completions", body, {"X-Request-Id": "same"}), range(2)))
    assert [ok(r)["id"] for r in both] == ["cmpl-same"] * 2
    assert [r.json()["usage"]["completion_tokens"] for r in both] == [24, 24]

    refused = post(server, "/v1/completions", {"prompt": PROMPT, "frobnicate": 1}, {"X-Request-Id": "err-3"})
    assert refused.status_code == 400 and refused.headers["X-Request-Id"] == "err-3"


# --- continue_final_message ---------------------------------------------------------


def test_continue_final_message_renders_the_last_message_open(server, tok):
    messages = [*MESSAGES, {"role": "assistant", "content": "Once upon a"}]
    expected = chat_prompt_ids(tok, messages, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(expected).endswith("Once upon a")
    body = {"messages": messages, "continue_final_message": True, "return_token_ids": True, **GREEDY}
    for extra in ({"add_generation_prompt": False}, {}):
        reply = ok(post(server, "/v1/chat/completions", {**body, **extra}))
        assert reply["prompt_token_ids"] == expected
        assert reply["choices"][0]["message"]["role"] == "assistant"
    both = post(server, "/v1/chat/completions", {**body, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


# --- no field silently ignored -------------------------------------------------------

COMPLETION = {"prompt": PROMPT, "max_tokens": 2}
CHAT = {"messages": MESSAGES, "max_tokens": 2}

# vLLM request fields Trillium does not implement (or only in their "off" value), with a value that is on.
REFUSED = [
    ("use_beam_search", True), ("length_penalty", 0.5), ("watermarking", True),
    ("thinking_token_budget", 8), ("routed_experts_prompt_start", 2),
    ("return_token_offsets", True), ("return_mm_kwargs", False), ("store", True), ("service_tier", "flex"),
    ("logprob_token_ids", [5]),
    ("prompt_embeds", "AAAA"), ("kv_transfer_params", {"do_remote_prefill": True}),
    ("ec_transfer_params", {"x": 1}), ("vllm_xargs", {"k": 1}), ("repetition_detection", {"n": 3}),
    ("stream_interval", 4), ("mm_processor_kwargs", {"k": 1}), ("media_io_kwargs", {"image": {"k": 1}}),
    ("frobnicate", 1),
]
CHAT_REFUSED = [
    # NOTE: include_reasoning, documents, chat_template and reasoning_effort are implemented
    # now (tests/data_plane/test_dp_tools_serve.py; chat_template without the server's
    # --trust-request-chat-template is a 400 in test_dp_errors.py).
    ("echo", True), ("return_prompt_text", True), ("modalities", ["audio"]),
    ("functions", [{"name": "f"}]), ("audio", {"voice": "x"}),
]
CASES = (
    [("/v1/completions", COMPLETION, {name: value}, name) for name, value in REFUSED]
    + [("/v1/chat/completions", CHAT, {name: value}, name) for name, value in REFUSED + CHAT_REFUSED]
    + [
        ("/v1/completions", COMPLETION, {"stream": True, "stream_options": {"continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats"),
        ("/v1/completions", COMPLETION, {"stream": True, "stream_options": {"frob": 1}}, "stream_options.frob"),
        ("/v1/completions", COMPLETION, {"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
        ("/v1/completions", COMPLETION, {"priority": 1}, "priority"),
        ("/v1/completions", COMPLETION, {"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
        ("/v1/completions", COMPLETION, {"cache_salt": ""}, "cache_salt"),
        ("/v1/completions", COMPLETION, {"allowed_token_ids": []}, "allowed_token_ids"),
        ("/v1/completions", COMPLETION, {"allowed_token_ids": [10**5]}, "allowed_token_ids"),
        ("/v1/completions", COMPLETION, {"bad_words": [""]}, "bad_words"),
        ("/v1/completions", COMPLETION, {"prompt_logprobs": 21}, "prompt_logprobs"),
        # NOTE: an assistant turn's reasoning_content is accepted now (test_dp_tools_serve.py).
        ("/v1/chat/completions", {**CHAT, "messages": [*MESSAGES, {"role": "assistant", "content": "a",
                                                                   "audio": {"id": "hm"}}]},
         {}, "messages[1].audio"),
    ]
)


@pytest.mark.parametrize(("path", "base", "extra", "param"), CASES,
                         ids=[f"{p.rsplit('/', 1)[1]}-{param}" for p, _, _, param in CASES])
def test_unimplemented_fields_are_a_400_naming_them(server, path, base, extra, param):
    response = post(server, path, {**base, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param.split("[")[0].split(".")[0] in error["message"]


def test_off_values_and_informational_fields_are_accepted(server):
    off = {"use_beam_search": False, "length_penalty": 1, "watermarking": False,
           "spaces_between_special_tokens": True, "store": False, "service_tier": "auto",
           "structured_outputs": None, "guided_json": None, "vllm_xargs": {}, "stream_interval": None,
           "user": "u", "metadata": {"run": "7"}, "session_id": "s", "safety_identifier": "x",
           "prompt_cache_key": "k"}
    assert ok(post(server, "/v1/completions", {**COMPLETION, **off}))["choices"]
    chat_off = {**off, "echo": False, "include_reasoning": True, "modalities": ["text"], "parallel_tool_calls": True,
                "messages": [*MESSAGES, {"role": "assistant", "content": "a", "refusal": None}, *MESSAGES]}
    assert ok(post(server, "/v1/chat/completions", {**CHAT, **chat_off}))["choices"]
