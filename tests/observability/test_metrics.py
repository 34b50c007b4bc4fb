"""Engine metrics under a scripted load, scraped from a real `trillium serve`.

Token-id prompts, ignore_eos and no prefix caching make every count exact:
the counters equal what was sent, each histogram has one observation per
request (per token for inter-token latency, per step for step sizes), and
the step sizes add up to the tokens computed. Both ports serve the same
series, and no counter goes backwards across sleep / wake / weight update.
"""

from __future__ import annotations

import concurrent.futures
import re

import httpx
import pytest

from support.serve_process import ServeProcess


TOKEN = "metrics-admin-token"
PROMPTS = [[5 + i, 6, 7, 8 + i, 9, 10 + i][: 3 + i % 4] for i in range(6)]
MAX_TOKENS = [4, 7, 3, 9, 5, 6]


def _samples(text: str) -> dict[str, float]:
    """'name{labels}' -> value, with the model_name label dropped for brevity."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, value = line.rsplit(" ", 1)
        key = re.sub(r'model_name="[^"]*",?', "", key).replace(",}", "}").replace("{}", "")
        out[key] = float(value)
    return out


@pytest.fixture(scope="module")
def server(checkpoint):
    proc = ServeProcess(str(checkpoint("llama")), "--no-enable-prefix-caching", "--kv-cache-memory", "4MiB",
                        env={"TRILLIUM_ADMIN_TOKEN": TOKEN}).wait_healthy()
    yield proc
    proc.stop()


def _scrape(server, admin: bool = False) -> dict[str, float]:
    if admin:
        text = httpx.get(server.admin_url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).text
    else:
        text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return _samples(text)


def _complete(server, prompt, max_tokens) -> dict:
    body = {"model": "test-model", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_counts_and_histograms_match_the_requests_sent(server):
    before = _scrape(server)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda args: _complete(server, *args), zip(PROMPTS, MAX_TOKENS)))
    assert [r["usage"]["completion_tokens"] for r in replies] == MAX_TOKENS
    after = _scrape(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    n, prompt_tokens, generated = len(PROMPTS), sum(map(len, PROMPTS)), sum(MAX_TOKENS)
    assert delta('trillium:request_success_total{finished_reason="length"}') == n
    assert delta('trillium:request_success_total{finished_reason="stop"}') == 0
    assert delta("trillium:prompt_tokens_total") == prompt_tokens
    assert delta("trillium:generation_tokens_total") == generated
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prefill_time_seconds", "request_decode_time_seconds",
                      "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert delta(f"trillium:{histogram}_count") == n, histogram
    assert delta("trillium:request_prompt_tokens_sum") == prompt_tokens
    assert delta("trillium:request_generation_tokens_sum") == generated
    assert delta("trillium:inter_token_latency_seconds_count") == generated - n
    # Every prompt token and every fed-back output token is computed once (no cache, no preemption).
    assert delta("trillium:iteration_tokens_total_sum") == prompt_tokens + generated - n
    assert delta("trillium:iteration_tokens_total_count") == delta("trillium:engine_step_duration_seconds_count") > 0
    assert delta("trillium:num_preemptions_total") == 0
    for actor in ("executor", "detokenizer", "scheduler"):
        assert after[f'trillium:actor_up{{actor="{actor}"}}'] == 1
    assert 'trillium:actor_mailbox_depth{actor="scheduler"}' in after
    assert after["trillium:num_requests_running"] == 0

    admin = _scrape(server, admin=True)
    for name in ("trillium:generation_tokens_total", "trillium:e2e_request_latency_seconds_count",
                 'trillium:request_success_total{finished_reason="length"}'):
        assert admin[name] == after[name], name
    assert admin['trillium:engine_state{state="serving"}'] == 1


def test_counters_never_go_backwards_across_sleep_wake_and_weight_update(server, checkpoint):
    _complete(server, [5, 6, 7], 3)
    before = _scrape(server)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    for path, body in (("/sleep", {"level": 1}), ("/wake_up", {}),
                       ("/update_weights_from_disk", {"model_path": str(checkpoint("llama"))})):
        response = httpx.post(server.admin_url + path, json=body, headers=headers, timeout=60)
        assert response.status_code == 200, (path, response.text)
    _complete(server, [5, 6, 7], 3)
    after = _scrape(server)
    counters = [k for k in before if k.endswith(("_total", "_count", "_sum")) or "_total{" in k]
    assert counters
    for name in counters:
        assert after.get(name, 0.0) >= before[name], name
    assert after["trillium:generation_tokens_total"] == before["trillium:generation_tokens_total"] + 3
    assert after['trillium:weight_updates_total{outcome="success",source="disk"}'] >= 1


def test_a_tiny_kv_cache_shows_preemptions(checkpoint):
    # 12 blocks of 16 tokens; each request needs up to 5 blocks, eight at once need 40.
    proc = ServeProcess(str(checkpoint("llama")), "--kv-cache-memory", "96KiB", "--max-model-len", "96",
                        "--no-enable-prefix-caching").wait_healthy()
    try:
        prompts = [[5 + i] * 20 for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda p: _complete(proc, p, 60), prompts))
        assert all(r["usage"]["completion_tokens"] == 60 for r in replies)
        metrics = _scrape(proc)
        assert metrics["trillium:num_preemptions_total"] > 0
        assert metrics['trillium:request_success_total{finished_reason="length"}'] == 8
        assert metrics["trillium:generation_tokens_total"] == 8 * 60
    finally:
        proc.stop()


def test_a_stop_string_met_by_the_last_allowed_token_counts_as_the_client_saw_it(server):
    text = _complete(server, [5, 6, 7], 4)["choices"][0]["text"]
    assert text
    before = _scrape(server)
    body = {"model": "test-model", "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "temperature": 0,
            "stop": [text]}
    reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()
    assert reply["choices"][0]["finish_reason"] == "stop"
    after = _scrape(server)
    stop, length = ('trillium:request_success_total{finished_reason="%s"}' % r for r in ("stop", "length"))
    assert (after[stop] - before[stop], after[length] - before[length]) == (1, 0)
