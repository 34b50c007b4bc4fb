"""Pooling routes over HTTP on the in-process harness: what a retrieval app sees.

Shapes mirror vLLM's pooling protocol (vllm/entrypoints/pooling/{embed,
classify,pooling,score}/protocol.py) and OpenAI's embeddings API (the
openai SDK asks for base64 by default and decodes it). Values are checked
against transformers on the same float32 checkpoint within 1e-4: the
embedding model's normalized last hidden state, a one-label classifier
(reward model / cross-encoder) read through sigmoid. Bad input, the wrong
task, and generation on a pooling model (or pooling on a generative one)
are 400s in OpenAI's error shape.
"""

from __future__ import annotations

import base64
import functools

import httpx
import numpy as np
import openai
import pytest
import torch

from support.data_plane_server import MODEL_NAME, ServerHarness

TOL = 1e-4
TEXTS = ["the quick brown fox", "a little robot paints the sea", "tall green trees by the river"]


@pytest.fixture(scope="module")
def embed_server(checkpoint):
    harness = ServerHarness(checkpoint("qwen3-embed"), {"default": {}}, max_num_batched_tokens=32,
                            kv_cache_memory="16MiB").start()
    yield harness
    harness.stop()


@pytest.fixture(scope="module")
def reward_server(checkpoint):
    harness = ServerHarness(checkpoint("qwen3-reward"), {"default": {}}, max_num_batched_tokens=32,
                            kv_cache_memory="16MiB").start()
    yield harness
    harness.stop()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url() + path, json=body, timeout=30)


def _error(response: httpx.Response, param: str | None = None) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


@functools.lru_cache(maxsize=4)
def _hf(path: str, kind: str):
    from transformers import AutoModel, AutoModelForSequenceClassification

    cls = AutoModel if kind == "embed" else AutoModelForSequenceClassification
    return cls.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def _hf_last_hidden(path, tokenizer, text: str) -> np.ndarray:
    hf = _hf(str(path), "embed")
    return hf(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0, -1].numpy()


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def test_embeddings_through_the_openai_sdk(embed_server):
    client = openai.OpenAI(base_url=embed_server.url() + "/v1", api_key="unused", max_retries=0)
    result = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # the SDK asks for base64
    last = [_hf_last_hidden(embed_server.model_path, embed_server.tokenizer, t) for t in TEXTS]
    assert [d.index for d in result.data] == [0, 1, 2]
    for data, want in zip(result.data, last):
        np.testing.assert_allclose(data.embedding, _unit(want), atol=TOL)
    num_tokens = sum(len(embed_server.tokenizer.encode(t)) for t in TEXTS)
    assert result.usage.prompt_tokens == result.usage.total_tokens == num_tokens
    cut = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], encoding_format="float", dimensions=32)
    np.testing.assert_allclose(cut.data[0].embedding, _unit(last[0][:32]), atol=TOL)  # cut, then normalize


def test_embeddings_token_ids_base64_and_raw(embed_server):
    ids = embed_server.tokenizer.encode(TEXTS[1])
    by_text = _post(embed_server, "/v1/embeddings", {"input": TEXTS[1]}).json()
    by_ids = _post(embed_server, "/v1/embeddings", {"input": [ids, ids[:3]], "encoding_format": "base64"}).json()
    assert by_text["object"] == "list" and by_text["model"] == MODEL_NAME
    decoded = np.frombuffer(base64.b64decode(by_ids["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, by_text["data"][0]["embedding"], atol=TOL)
    raw = _post(embed_server, "/pooling", {"input": TEXTS[1], "use_activation": False}).json()
    assert raw["data"][0]["object"] == "pooling"
    want = _hf_last_hidden(embed_server.model_path, embed_server.tokenizer, TEXTS[1])
    np.testing.assert_allclose(raw["data"][0]["data"], want, atol=TOL * max(1.0, float(np.abs(want).max())))


def test_embedding_model_score_and_rerank_use_cosine(embed_server):
    vectors = [np.array(d["embedding"]) for d in _post(embed_server, "/v1/embeddings", {"input": TEXTS}).json()["data"]]
    score = _post(embed_server, "/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    assert [d["index"] for d in score["data"]] == [0, 1]
    for d, v in zip(score["data"], vectors[1:]):
        assert d["object"] == "score" and d["score"] == pytest.approx(float(vectors[0] @ v), abs=TOL)
    rerank = _post(embed_server, "/v1/rerank", {"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1,
                                                "return_documents": False}).json()
    best = int(np.argmax([vectors[0] @ v for v in vectors[1:]]))
    assert [r["index"] for r in rerank["results"]] == [best] and "document" not in rerank["results"][0]


def test_embeddings_bad_input(embed_server):
    assert "matryoshka" in _error(_post(embed_server, "/v1/embeddings", {"input": "x", "dimensions": 20}),
                                  "dimensions")
    _error(_post(embed_server, "/v1/embeddings", {"input": []}), "input")
    _error(_post(embed_server, "/v1/embeddings", {"input": [1, "a"]}), "input")
    _error(_post(embed_server, "/v1/embeddings", {"input": "x", "encoding_format": "int8"}), "encoding_format")
    _error(_post(embed_server, "/v1/embeddings", {"input": "x", "truncate_prompt_tokens": -2}),
           "truncate_prompt_tokens")
    _error(_post(embed_server, "/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 10**6}),
           "truncate_prompt_tokens")  # past the context
    _error(_post(embed_server, "/v1/embeddings", {"input": "x", "add_generation_prompt": True}),
           "add_generation_prompt")  # a chat field without messages
    _error(_post(embed_server, "/v1/embeddings", {"input": "x", "messages": [{"role": "user", "content": "x"}]}),
           "input")
    _error(_post(embed_server, "/v1/embeddings", {"messages": []}), "messages")
    _error(_post(embed_server, "/pooling", {"messages": [{"role": "user", "content": "x"}],
                                            "add_generation_prompt": True, "continue_final_message": True}),
           "continue_final_message")
    _error(_post(embed_server, "/v1/embeddings", {"messages": [{"role": "user", "content": "x"}],
                                                  "chat_template": "{{ 1 }}"}), "chat_template")
    _error(_post(embed_server, "/v1/embeddings", {"input": "x", "padding": "max_length"}), "padding")
    _error(_post(embed_server, "/v1/embeddings", {"input": [[10**6]]}), "input")
    _error(_post(embed_server, "/v1/embeddings", {"input": [1] * 300}), "input")  # past the context
    _error(_post(embed_server, "/v1/embeddings", {"input": ["a"] * 10_000}), "input")  # --max-prompts-per-request
    assert "pooling task" in _error(_post(embed_server, "/classify", {"input": "x"}), "model")
    assert "pooling model" in _error(_post(embed_server, "/v1/completions", {"prompt": "x", "max_tokens": 2}))
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert "pooling model" in _error(_post(embed_server, "/v1/chat/completions", chat))
    _error(_post(embed_server, "/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}), "text_1")


def test_truncate_prompt_tokens_keeps_the_last_tokens(embed_server):
    """vllm/entrypoints/renderer.py: k keeps the last k tokens (the tokenizer truncates on the
    left), -1 means the context; truncation_side "right" keeps the first k."""
    ids = embed_server.tokenizer.encode(TEXTS[1])
    hf = functools.partial(_hf_ids_last_hidden, embed_server.model_path)
    body = _post(embed_server, "/v1/embeddings", {"input": [TEXTS[1], ids], "truncate_prompt_tokens": 3}).json()
    assert body["usage"]["prompt_tokens"] == 6
    for d in body["data"]:
        np.testing.assert_allclose(d["embedding"], _unit(hf(ids[-3:])), atol=TOL)
    right = _post(embed_server, "/pooling", {"input": ids, "truncate_prompt_tokens": 2, "truncation_side": "right",
                                             "use_activation": False}).json()
    np.testing.assert_allclose(right["data"][0]["data"], hf(ids[:2]), atol=TOL * 10)
    whole = _post(embed_server, "/v1/embeddings", {"input": ids, "truncate_prompt_tokens": -1}).json()
    np.testing.assert_allclose(whole["data"][0]["embedding"], _unit(hf(ids)), atol=TOL)
    score = _post(embed_server, "/score", {"text_1": TEXTS[0], "text_2": TEXTS[1], "truncate_prompt_tokens": 2})
    assert score.json()["usage"]["prompt_tokens"] == 4


def test_embeddings_of_chat_messages(embed_server):
    """vllm/entrypoints/pooling/base/protocol.py ChatRequestMixin: the messages rendered with the
    chat template (add_generation_prompt false, add_special_tokens false by default)."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": TEXTS[0]}]
    hf_tok = embed_server.tokenizer.hf
    for extra, kwargs in (({}, {"add_generation_prompt": False}),
                          ({"add_generation_prompt": True}, {"add_generation_prompt": True})):
        text = hf_tok.apply_chat_template(messages, tokenize=False, **kwargs)
        ids = hf_tok.encode(text, add_special_tokens=False)
        body = _post(embed_server, "/v1/embeddings", {"messages": messages, **extra}).json()
        assert body["usage"]["prompt_tokens"] == len(ids)
        np.testing.assert_allclose(body["data"][0]["embedding"],
                                   _unit(_hf_ids_last_hidden(embed_server.model_path, ids)), atol=TOL)
    opened = messages + [{"role": "assistant", "content": "a fox"}]
    cont = _post(embed_server, "/pooling", {"messages": opened, "continue_final_message": True,
                                            "truncate_prompt_tokens": 4}).json()
    text = hf_tok.apply_chat_template(opened, tokenize=False, continue_final_message=True)
    ids = hf_tok.encode(text, add_special_tokens=False)[-4:]
    assert cont["usage"]["prompt_tokens"] == 4
    np.testing.assert_allclose(cont["data"][0]["data"], _unit(_hf_ids_last_hidden(embed_server.model_path, ids)),
                               atol=TOL)


@torch.inference_mode()
def _hf_ids_last_hidden(path, ids: list[int]) -> np.ndarray:
    return _hf(str(path), "embed")(torch.tensor([ids])).last_hidden_state[0, -1].numpy()


@pytest.fixture(scope="module")
def token_server(checkpoint):
    harness = ServerHarness(checkpoint("qwen3-embed"), {"default": {}}, max_num_batched_tokens=8,
                            kv_cache_memory="16MiB", pooler_config='{"pooling_type": "ALL"}').start()
    yield harness
    harness.stop()


def test_all_pooling_returns_a_row_per_token(token_server):
    """vllm/model_executor/layers/pooler/tokwise/methods.py AllPool: every prompt token's hidden
    state (chunked prefill: 8-token steps), each row normalized (TokenEmbeddingPoolerHead);
    served by /pooling only."""
    path, tokenizer = token_server.model_path, token_server.tokenizer
    body = _post(token_server, "/pooling", {"input": TEXTS[2]}).json()
    ids = tokenizer.encode(TEXTS[2])
    with torch.inference_mode():
        want = _hf(str(path), "embed")(torch.tensor([ids])).last_hidden_state[0].numpy()
    rows = np.array(body["data"][0]["data"])
    assert rows.shape == want.shape and len(ids) > 8
    np.testing.assert_allclose(rows, want / np.linalg.norm(want, axis=-1, keepdims=True), atol=TOL)
    packed = _post(token_server, "/pooling", {"input": [ids[:3]], "encoding_format": "base64",
                                              "use_activation": False}).json()
    flat = np.frombuffer(base64.b64decode(packed["data"][0]["data"]), dtype="<f4").reshape(3, -1)
    np.testing.assert_allclose(flat, want[:3], atol=TOL * max(1.0, float(np.abs(want).max())))
    assert "use /pooling" in _error(_post(token_server, "/v1/embeddings", {"input": "x"}), "model")
    assert "use /pooling" in _error(_post(token_server, "/score", {"text_1": "a", "text_2": "b"}), "model")


@torch.inference_mode()
def _hf_reward(path, ids: list[int]) -> float:
    return float(_hf(str(path), "classify")(torch.tensor([ids])).logits[0, 0])


def _sigmoid(x: float) -> float:
    return float(1 / (1 + np.exp(-x)))


def test_classify_a_reward_model(reward_server):
    body = _post(reward_server, "/classify", {"input": TEXTS[:2]}).json()
    assert body["object"] == "list" and len(body["data"]) == 2
    for d, text in zip(body["data"], TEXTS):
        logit = _hf_reward(reward_server.model_path, reward_server.tokenizer.encode(text))
        assert d["label"] == "LABEL_0" and d["num_classes"] == 1
        assert d["probs"][0] == pytest.approx(_sigmoid(logit), abs=TOL)
    raw = _post(reward_server, "/classify", {"input": TEXTS[0], "use_activation": False}).json()
    logit = _hf_reward(reward_server.model_path, reward_server.tokenizer.encode(TEXTS[0]))
    assert raw["data"][0]["probs"][0] == pytest.approx(logit, abs=TOL)


def test_rerank_with_a_cross_encoder(reward_server):
    query = "the fox"
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = _post(reward_server, path, {"query": query, "documents": TEXTS}).json()
        expected = [_sigmoid(_hf_reward(reward_server.model_path,
                                        reward_server.tokenizer.hf(query, text_pair=d)["input_ids"])) for d in TEXTS]
        assert [r["index"] for r in body["results"]] == sorted(range(3), key=lambda i: -expected[i])
        for r in body["results"]:
            assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=TOL)
            assert r["document"] == {"text": TEXTS[r["index"]]}
        assert body["usage"]["total_tokens"] > 0
    score = _post(reward_server, "/v1/score", {"text_1": query, "text_2": TEXTS[0]}).json()
    assert score["data"][0]["score"] == pytest.approx(expected[0], abs=TOL)


def test_classifier_refuses_embeddings_and_bad_rerank(reward_server):
    assert "pooling task" in _error(_post(reward_server, "/v1/embeddings", {"input": "x"}), "model")
    _error(_post(reward_server, "/rerank", {"query": "q", "documents": []}), "documents")
    _error(_post(reward_server, "/rerank", {"query": "q", "documents": ["d"], "top_n": -1}), "top_n")
    _error(_post(reward_server, "/rerank", {"query": "q", "documents": ["d"], "unknown": 1}), "unknown")
    _error(_post(reward_server, "/classify", {"input": "x", "priority": 2}), "priority")


def test_generative_model_refuses_pooling_routes(dp_server):
    for path, body in (("/v1/embeddings", {"input": "x"}), ("/classify", {"input": "x"}),
                       ("/rerank", {"query": "q", "documents": ["d"]}), ("/score", {"text_1": "a", "text_2": "b"})):
        assert "--runner pooling" in _error(_post(dp_server, path, body), "model")


@torch.inference_mode()
def _hf_token_logits(path, ids: list[int]) -> np.ndarray:
    hf = _hf(str(path), "classify")
    return hf.score(hf.model(torch.tensor([ids])).last_hidden_state)[0].numpy()


def test_pooling_task_per_request(reward_server):
    """vllm/entrypoints/pooling/pooling/protocol.py `task` and serving.py: a classifier serves
    classify and token_classify (DispatchPooler.for_seq_cls: the score head on every row, AllPool);
    any other task is a 400 naming it ("Unsupported task: ... Supported tasks: ...")."""
    ids = reward_server.tokenizer.encode(TEXTS[1])
    body = _post(reward_server, "/pooling", {"input": TEXTS[1], "task": "token_classify"}).json()
    logits = _hf_token_logits(reward_server.model_path, ids)
    np.testing.assert_allclose(body["data"][0]["data"], 1 / (1 + np.exp(-logits)), atol=TOL)
    seq = _post(reward_server, "/pooling", {"input": TEXTS[1], "task": "classify", "use_activation": False}).json()
    np.testing.assert_allclose(seq["data"][0]["data"], logits[-1], atol=TOL)
    for task in ("token_embed", "embed", "plugin"):
        message = _error(_post(reward_server, "/pooling", {"input": "x", "task": task}), "task")
        assert f"Unsupported task: {task!r}" in message and "token_classify" in message


def test_step_pooling_end_to_end(checkpoint):
    """vllm/model_executor/layers/pooler/tokwise/methods.py StepPool with vllm/config/pooler.py's
    step_tag_id / returned_token_ids: a process reward model's rows at the step-tag token, its
    returned label columns; 8-token chunks. `task` "classify" on the same server pools LAST."""
    from transformers import AutoTokenizer

    path = checkpoint("qwen3-reward")
    ids = AutoTokenizer.from_pretrained(str(path)).encode(TEXTS[2])
    step = ids[3]
    config = f'{{"pooling_type": "STEP", "step_tag_id": {step}, "returned_token_ids": [0]}}'
    harness = ServerHarness(path, {"default": {}}, max_num_batched_tokens=8, kv_cache_memory="16MiB",
                            pooler_config=config).start()
    try:
        logits = _hf_token_logits(path, ids)
        body = _post(harness, "/pooling", {"input": [ids], "use_activation": False}).json()
        want = logits[np.array(ids) == step][:, [0]]
        assert len(ids) > 8 and len(want) >= 1
        np.testing.assert_allclose(body["data"][0]["data"], want, atol=TOL)
        seq = _post(harness, "/pooling", {"input": [ids], "task": "classify", "use_activation": False}).json()
        np.testing.assert_allclose(seq["data"][0]["data"], logits[-1], atol=TOL)
    finally:
        harness.stop()
