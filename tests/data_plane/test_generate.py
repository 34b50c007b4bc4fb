"""SGLang's native /generate against a real `trillium serve`, raw HTTP (httpx), as SGLang clients call it.

Shapes are checked against SGLang's own code (sgl-project/sglang):
- request body: `GenerateReqInput` in python/sglang/srt/managers/io_struct.py (text | input_ids,
  one or a batch; `normalize_batch_and_arguments`: n > 1 expands each prompt, rid prefix `<rid>_<i>`);
- sampling_params: `SamplingParams` in python/sglang/srt/sampling/sampling_params.py (names, defaults);
- response / meta_info, the cumulative (non-incremental) stream and the prompt-major order of n > 1
  samples: `TokenizerManager._handle_batch_output`, `_wait_one_response` and `_handle_batch_request`
  in python/sglang/srt/managers/tokenizer_manager.py;
- finish_reason dicts: FINISH_MATCHED_TOKEN / FINISH_MATCHED_STR / FINISH_LENGTH in
  python/sglang/srt/managers/schedule_batch.py;
- input_token_logprobs (from logprob_start_len, default the last prompt token, first entry null):
  `_process_input_token_logprobs` in python/sglang/srt/managers/scheduler_output_processor_mixin.py
  and the scheduler's `handle_generate_request` (python/sglang/srt/managers/scheduler.py);
- SSE framing `data: {...}` ... `data: [DONE]`: `generate_request` in
  python/sglang/srt/entrypoints/http_server.py.

Oracles: the engine's own /v1/completions (greedy tokens, logprobs) and transformers greedy
(support.oracles.hf_greedy) on the same synthetic checkpoint.
"""

from __future__ import annotations

import json

import httpx
import pytest

from support.oracles import hf_greedy, transformers_model
from support.serve_process import ServeProcess

KEY = "sk-generate"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = [[5, 17, 99, 250, 31], [400, 3, 77, 12, 8, 190, 44]]
N_TOKENS = 8


@pytest.fixture(scope="module")
def model_path(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def server(model_path):
    proc = ServeProcess(str(model_path), "--max-num-seqs", "16", "--kv-cache-memory", "16MiB",
                        env={"TRILLIUM_API_KEY": KEY}).wait_healthy()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


@pytest.fixture(scope="module")
def hf_reference(model_path):
    """transformers greedy (EOS masked for N_TOKENS steps) and its top logprobs, per prompt."""
    model = transformers_model(model_path)
    return [hf_greedy(model, ids, N_TOKENS, top_n=3) for ids in PROMPTS]


def generate(server, body: dict, status: int = 200):
    response = httpx.post(server.base_url + "/generate", json=body, headers=AUTH, timeout=60)
    assert response.status_code == status, response.text
    return response.json()


def greedy(**extra) -> dict:
    return {"temperature": 0, "max_new_tokens": N_TOKENS, "min_new_tokens": N_TOKENS, **extra}


def completion(server, prompt, **body) -> dict:
    full = {"model": "test-model", "prompt": prompt, "max_tokens": N_TOKENS, "min_tokens": N_TOKENS,
            "temperature": 0, **body}
    response = httpx.post(server.base_url + "/v1/completions", json=full, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def sse_events(server, body: dict) -> list[dict]:
    """The `data:` payloads of a streamed /generate; the last must be [DONE]."""
    payloads = []
    with httpx.stream("POST", server.base_url + "/generate", json=body, headers=AUTH, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                payloads.append(line[len("data: "):])
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def test_greedy_output_ids_equal_completions_and_transformers(server, tokenizer, hf_reference):
    """One prompt -> one object (GenerateReqInput.is_single); output_ids are the greedy tokens of
    /v1/completions (same token strings and text) and of transformers."""
    for ids, (hf_tokens, _) in zip(PROMPTS, hf_reference):
        out = generate(server, {"input_ids": ids, "sampling_params": greedy(), "rid": f"greedy-{ids[0]}"})
        assert out["output_ids"] == hf_tokens
        choice = completion(server, ids, logprobs=0)
        assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in out["output_ids"]]
        assert out["text"] == choice["text"]
        meta = out["meta_info"]
        assert meta["id"] == f"greedy-{ids[0]}"
        assert meta["finish_reason"] == {"type": "length", "length": N_TOKENS}
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), N_TOKENS)
        assert isinstance(meta["cached_tokens"], int) and meta["e2e_latency"] > 0
        assert meta["weight_version"] == "0"
        assert "output_token_logprobs" not in meta  # only with return_logprob, as SGLang


def test_text_prompt_equals_completions(server):
    """`text` is tokenized as /v1/completions tokenizes `prompt`."""
    out = generate(server, {"text": "Once upon a time", "sampling_params": greedy()})
    assert out["text"] == completion(server, "Once upon a time")["text"]
    assert len(out["output_ids"]) == N_TOKENS


def test_batch_and_n_order_ids_and_shapes(server, hf_reference):
    """A batch answers a list; with n > 1 the samples come prompt by prompt, then sample by sample
    (TokenizerManager._handle_batch_request loops prompts, then parallel_sample_num); a string rid
    is the prefix of `<rid>_<i>` (GenerateReqInput._normalize_rid)."""
    batch = generate(server, {"input_ids": PROMPTS, "sampling_params": greedy(), "rid": "b"})
    assert [o["meta_info"]["id"] for o in batch] == ["b_0", "b_1"]
    assert [o["output_ids"] for o in batch] == [tokens for tokens, _ in hf_reference]
    sampled = generate(server, {"input_ids": PROMPTS, "sampling_params": greedy(n=2), "rid": "s"})
    assert len(sampled) == 4
    assert [o["meta_info"]["prompt_tokens"] for o in sampled] == [5, 5, 7, 7]
    assert [o["output_ids"] for o in sampled] == [hf_reference[0][0]] * 2 + [hf_reference[1][0]] * 2
    assert [o["meta_info"]["id"] for o in sampled] == ["s_0-0", "s_0-1", "s_1-0", "s_1-1"]
    one_n = generate(server, {"input_ids": PROMPTS[0], "sampling_params": {"n": 3, "max_new_tokens": 4}})
    assert isinstance(one_n, list) and len(one_n) == 3  # n > 1 turns one prompt into a batch
    per_prompt = generate(server, {"input_ids": PROMPTS, "sampling_params": [greedy(max_new_tokens=4, min_new_tokens=4),
                                                                              greedy(max_new_tokens=6, min_new_tokens=6)]})
    assert [o["meta_info"]["completion_tokens"] for o in per_prompt] == [4, 6]
    assert [o["output_ids"] for o in per_prompt] == [hf_reference[0][0][:4], hf_reference[1][0][:6]]


def test_logprobs_shapes_and_values_equal_completions(server, tokenizer, hf_reference):
    """output_token_logprobs / input_token_logprobs are [logprob, token_id, text-or-null] lists
    (TokenizerManager.detokenize_logprob_tokens); input ones start at logprob_start_len with a null
    first logprob. Values equal /v1/completions' (echo + logprobs) for the same tokens."""
    ids = PROMPTS[1]
    body = {"input_ids": ids, "sampling_params": greedy(), "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 3, "return_text_in_logprobs": True}
    meta = generate(server, body)["meta_info"]
    reference = completion(server, ids, logprobs=3, echo=True)["logprobs"]
    out_lp, in_lp = meta["output_token_logprobs"], meta["input_token_logprobs"]
    assert [e[1] for e in out_lp] == hf_reference[1][0]
    assert [e[2] for e in out_lp] == reference["tokens"][len(ids):]
    assert [e[0] for e in out_lp] == pytest.approx(reference["token_logprobs"][len(ids):], abs=1e-5)
    assert [e[1] for e in in_lp] == ids and in_lp[0][0] is None
    assert [e[0] for e in in_lp[1:]] == pytest.approx(reference["token_logprobs"][1:len(ids)], abs=1e-5)
    assert [e[2] for e in in_lp] == [tokenizer.decode([t]) for t in ids]
    for step, (top, (hf_ids, hf_lps)) in enumerate(zip(meta["output_top_logprobs"], hf_reference[1][1])):
        assert [e[1] for e in top] == hf_ids
        assert [e[0] for e in top] == pytest.approx(hf_lps, abs=1e-3)
        expected = reference["top_logprobs"][len(ids) + step]  # keyed by token text
        texts = [e[2] for e in top]
        assert all(expected[e[2]] == pytest.approx(e[0], abs=1e-5) for e in top if texts.count(e[2]) == 1)
    assert meta["input_top_logprobs"][0] is None
    assert all(len(t) == 3 for t in meta["input_top_logprobs"][1:])
    default = generate(server, {"input_ids": ids, "sampling_params": greedy(), "return_logprob": True})
    assert default["meta_info"]["input_token_logprobs"] == [[None, ids[-1], None]]
    assert [e[2] for e in default["meta_info"]["output_token_logprobs"]] == [None] * N_TOKENS
    assert "output_top_logprobs" not in default["meta_info"]


def test_stream_is_cumulative_and_reassembles_to_the_result(server):
    """SGLang's default stream (incremental_streaming_output off): each event carries the sample's
    text, output_ids and logprob lists so far; finish_reason and e2e_latency only on the last."""
    body = {"input_ids": PROMPTS[0], "sampling_params": greedy(), "return_logprob": True,
            "top_logprobs_num": 2, "rid": "stream-1"}
    full = generate(server, body)
    events = sse_events(server, {**body, "stream": True})
    assert len(events) >= 2 and all("index" not in e for e in events)
    for before, after in zip(events, events[1:]):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert after["text"].startswith(before["text"])
        assert before["meta_info"]["finish_reason"] is None and "e2e_latency" not in before["meta_info"]
    last = events[-1]
    for result in (last, full):
        result["meta_info"].pop("e2e_latency")
        assert isinstance(result["meta_info"].pop("cached_tokens"), int)  # the second run may hit the cache
    assert last == full
    batch = {"input_ids": PROMPTS, "sampling_params": greedy(n=2), "rid": "sb"}
    expected = generate(server, batch)
    final = {}
    for item in sse_events(server, {**batch, "stream": True}):
        final[item.pop("index")] = item
    assert sorted(final) == [0, 1, 2, 3]
    for index, result in enumerate(expected):
        assert final[index]["output_ids"] == result["output_ids"] and final[index]["text"] == result["text"]
        assert final[index]["meta_info"]["id"] == result["meta_info"]["id"]


def test_a_samples_stream_interval_paces_its_events(server):
    """SGLang's per-request sampling_params.stream_interval (python/sglang/srt/sampling/
    sampling_params.py; scheduler_output_processor_mixin.py streams a request when its output
    length % stream_interval == 1, i.e. its first token, then every interval tokens, and when it
    finishes): events of at least 5 new tokens after the first, the same result as unstreamed."""
    params = greedy(max_new_tokens=23, min_new_tokens=23, stream_interval=5)
    body = {"input_ids": PROMPTS[1], "sampling_params": params, "rid": "paced"}
    full = generate(server, body)
    events = sse_events(server, {**body, "stream": True})
    sizes = [len(after["output_ids"]) - len(before["output_ids"])
             for before, after in zip([{"output_ids": []}, *events], events)]
    assert sizes[0] == 1 and sum(sizes) == 23 and all(n >= 5 for n in sizes[1:-1]), sizes
    assert len(sizes) <= 1 + 22 // 5 + 1
    assert events[-1]["output_ids"] == full["output_ids"] and events[-1]["text"] == full["text"]


def test_finish_reason_matches_stop_string_and_stop_token(server):
    """FINISH_MATCHED_STR / FINISH_MATCHED_TOKEN: {"type": "stop", "matched": ...}; the text leaves the
    stop string out unless no_stop_trim; output_ids keep the matched stop token (its text is trimmed)."""
    free = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    ref = generate(server, {"input_ids": PROMPTS[0], "sampling_params": free})
    text, tokens = ref["text"], ref["output_ids"]
    stop = text[3:6]
    if not stop.strip():
        pytest.skip("reference text too short for a stop string")
    cut = generate(server, {"input_ids": PROMPTS[0], "sampling_params": {**free, "stop": [stop]}})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == text[: text.index(stop)]
    kept = generate(server, {"input_ids": PROMPTS[0], "sampling_params": {**free, "stop": stop, "no_stop_trim": True}})
    assert kept["text"] == text[: text.index(stop) + len(stop)]
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    by_id = generate(server, {"input_ids": PROMPTS[0], "sampling_params": {**free, "stop_token_ids": [stop_id]}})
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert by_id["output_ids"] == tokens[: first + 1]
    assert by_id["meta_info"]["completion_tokens"] == first + 1


@pytest.mark.parametrize(
    "body, param",
    [
        ({"text": "a", "frobnicate": 1}, "frobnicate"),
        ({"text": "a", "sampling_params": {"max_tokens": 4}}, "sampling_params.max_tokens"),
        ({"text": "a", "sampling_params": {"json_schema": "{\"type\": \"foo\"}"}}, "sampling_params.json_schema"),
        ({"text": "a", "sampling_params": {"regex": "[ab"}}, "sampling_params.regex"),
        ({"text": "a", "sampling_params": {"ebnf": "root ::= undefined_rule"}}, "sampling_params.ebnf"),
        ({"text": "a", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, "sampling_params.regex"),
        ({"text": "a", "return_hidden_states": True}, "return_hidden_states"),
        ({"text": "a", "lora_path": "no-such-adapter"}, "lora_path"),
        ({"text": "a", "input_ids": [1, 2]}, "text"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5000}}, "sampling_params.max_new_tokens"),
        ({"input_ids": [1, 99999]}, "input_ids"),
        ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
        ({"input_ids": [[1, 2], [3]], "sampling_params": [{"n": 2}, {"n": 1}]}, "sampling_params"),
        ({"input_ids": [1, 2], "sampling_params": {"stream_interval": 0}}, "sampling_params.stream_interval"),
        ({"input_ids": [1, 2], "sampling_params": {"stream_interval": "4"}}, "sampling_params.stream_interval"),
        ({"input_ids": [1, 2], "sampling_params": {"stream_interval": 1025}}, "sampling_params.stream_interval"),
    ],
)
def test_unknown_and_unimplemented_fields_are_400_naming_them(server, body, param):
    error = generate(server, body, status=400)["error"]
    assert error["param"] == param and param.rsplit(".", 1)[-1] in error["message"]


def test_defaults_of_unimplemented_fields_ask_nothing(server):
    """A client that sends SGLang's defaults of fields Trillium lacks (null grammars, image_data null,
    return_hidden_states false) is served: those values request no behaviour."""
    body = {"input_ids": PROMPTS[0], "image_data": None, "return_hidden_states": False,
            "sampling_params": greedy(json_schema=None, regex=None, spaces_between_special_tokens=True)}
    assert len(generate(server, body)["output_ids"]) == N_TOKENS


def test_spaces_between_special_tokens_false_is_served_everywhere(server, tokenizer):
    """slime's sampling_params (skip_special_tokens false, spaces_between_special_tokens false) on
    /generate, and vLLM's field of the same name on /v1/completions and /v1/chat/completions. The
    synthetic byte-level tokenizer puts nothing between added tokens, so the text is HF's own
    decode (tests/actors/detokenizer covers a decoder where the flag changes the text)."""
    sampling = greedy(skip_special_tokens=False, spaces_between_special_tokens=False, no_stop_trim=True)
    out = generate(server, {"input_ids": PROMPTS[0], "sampling_params": sampling})
    full = tokenizer.decode(PROMPTS[0] + out["output_ids"], skip_special_tokens=False)
    assert out["text"] == full[len(tokenizer.decode(PROMPTS[0], skip_special_tokens=False)):]
    choice = completion(server, PROMPTS[0], skip_special_tokens=False, spaces_between_special_tokens=False)
    assert choice["text"] == out["text"]
    chat = httpx.post(server.base_url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "spaces_between_special_tokens": False})
    assert chat.status_code == 200, chat.text


def test_api_key_guards_generate(server):
    """With --api-key, /generate needs the key like /v1/* (SGLang's api_key guards it too)."""
    response = httpx.post(server.base_url + "/generate", json={"text": "a"}, timeout=30)
    assert response.status_code == 401
    put = httpx.put(server.base_url + "/generate", json={"input_ids": [1, 2], "sampling_params": greedy()},
                    headers=AUTH, timeout=30)
    assert put.status_code == 200 and len(put.json()["output_ids"]) == N_TOKENS
    assert put.headers["X-Weight-Version"] == "0"
