"""Every bounded input at and over its cap, against a live `trillium serve` (ISSUE 16 items 3, 4, 8).

One server with small caps (each flag of README "Limits"): a request at a
cap is served, one over it is a 400 naming the field and the flag, or the
503 / 401 / 413 the table lists. Then the connection-level cases: the API
key is checked before the body is read (an unauthenticated 5 MB upload is
answered without being read), a slow-body client and 500 idle connections
do not keep a normal request from completing, and the connection cap
answers 503 without reading the body.

The caps mirror what the peers do where they have one: vLLM's
`--max-logprobs` (vllm/config/model.py, default 20) and OpenAI's n <= 128;
the others are Trillium's own (vLLM bounds none of them).
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from support.serve_process import ServeProcess

KEY = "sk-bounds"
AUTH = {"Authorization": f"Bearer {KEY}"}
CAPS = {
    "--max-prompts-per-request": 3, "--max-n": 3, "--max-stop-strings": 4, "--max-stop-string-chars": 8,
    "--max-logit-bias": 2, "--max-prompt-chars": 400, "--max-request-body-bytes": 65536,
    "--max-queued-requests": 4, "--max-queue-time-s": 2, "--max-concurrent-connections": 3,
}
CONTEXT = 16384
# WHY this long: the tiny model makes thousands of tokens a second; the stream must
# hold its sequence slots while the test's other requests arrive.
LONG = {"prompt": "Once upon a time", "max_tokens": CONTEXT - 64, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(checkpoint):
    args = [str(a) for flag, value in CAPS.items() for a in (flag, value)]
    proc = ServeProcess(str(checkpoint("llama", max_position_embeddings=CONTEXT)), "--api-key", KEY,
                        "--metrics-without-auth", "--max-num-seqs", "2", "--executor-threads", "1",
                        "--kv-cache-memory", "64MiB", *args)
    try:
        yield proc.wait_healthy(timeout_s=600)
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        yield client


def _error(response: httpx.Response, status: int, param: str | None, flag: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    if flag is not None:
        assert flag in error["message"], error
    return error


def _complete(http, **body):
    return http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2, **body})


def test_each_request_cap_at_and_over(http):
    assert _complete(http, prompt=["a", "b", "c"]).status_code == 200
    _error(_complete(http, prompt=["a", "b", "c", "d"]), 400, "prompt", "--max-prompts-per-request")
    assert len(_complete(http, n=3).json()["choices"]) == 3
    _error(_complete(http, n=4), 400, "n", "--max-n")
    assert _complete(http, stop=["12345678", "b", "c", "d"]).status_code == 200
    _error(_complete(http, stop=["a", "b", "c", "d", "e"]), 400, "stop", "--max-stop-strings")
    _error(_complete(http, stop=["123456789"]), 400, "stop", "--max-stop-string-chars")
    assert _complete(http, logit_bias={"5": 1.0, "6": -1.0}).status_code == 200
    _error(_complete(http, logit_bias={"5": 1.0, "6": 1.0, "7": 1.0}), 400, "logit_bias", "--max-logit-bias")
    # chat and SGLang's /generate go through the same caps, in their own field names
    messages = [{"role": "user", "content": "hi"}]
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "n": 4})
    _error(chat, 400, "n", "--max-n")
    generate = http.post("/generate", json={"text": "Once", "sampling_params": {"max_new_tokens": 2,
                                                                               "stop": list("abcde")}})
    _error(generate, 400, "sampling_params.stop", "--max-stop-strings")
    _error(http.post("/generate", json={"text": ["a"] * 4, "sampling_params": {"max_new_tokens": 1}}), 400,
           "text", "--max-prompts-per-request")


def test_text_and_token_lengths_are_checked_before_the_work(http):
    assert _complete(http, prompt="ab" * 200).status_code == 200  # 400 characters
    _error(_complete(http, prompt="ab" * 200 + "c"), 400, "prompt", "--max-prompt-chars")
    _error(http.post("/tokenize", json={"prompt": "x" * 401}), 400, "prompt", "--max-prompt-chars")
    long_chat = [{"role": "user", "content": "x" * 300}, {"role": "user", "content": "y" * 101}]
    _error(http.post("/v1/chat/completions", json={"messages": long_chat}), 400, "messages", "--max-prompt-chars")
    _error(_complete(http, prompt=[5] * CONTEXT), 400, "prompt")  # by its length, not its ids
    assert http.post("/detokenize", json={"tokens": [5] * CONTEXT}).status_code == 200
    _error(http.post("/detokenize", json={"tokens": [5] * (CONTEXT + 1)}), 400, "tokens")


def test_body_cap_and_the_key_before_the_body(server, http):
    filler = "u" * (65536 - 200)
    assert _complete(http, user=filler).status_code == 200  # just under the cap
    assert _complete(http, user=filler + "u" * 400).status_code == 413
    with httpx.Client(base_url=server.base_url, timeout=60) as anonymous:
        for path in ("/tokenize", "/detokenize", "/v1/models", "/generate"):
            assert anonymous.post(path, json={}).status_code == 401, path
        assert anonymous.get("/metrics").status_code == 200  # --metrics-without-auth
        assert anonymous.get("/health").status_code == 200
    # An unauthenticated 5 MB upload: the 401 comes after the headers alone, the body is never read.
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5000000\r\n\r\n")
        head = sock.recv(65536).decode(errors="replace")
    assert head.startswith("HTTP/1.1 401") and "connection: close" in head.lower(), head


def _until_both_choices_stream(stream):
    """Read the n=2 stream until both choices produced text (both hold a sequence slot);
    returns the line iterator, which the caller must hold: a dropped iterator closes the
    response, which the server sees as a disconnect (and aborts the request)."""
    seen, lines, iterator = set(), [], stream.iter_lines()
    for line in iterator:
        lines.append(line)
        if line.startswith("data: {"):
            seen.update(c["index"] for c in json.loads(line[len("data: "):]).get("choices", ()))
        if seen == {0, 1}:
            return iterator
    raise AssertionError(f"the stream ended early: {lines[-3:]}")


def test_admission_counts_engine_requests(server, http):
    assert len(_complete(http, prompt=["a", "b"], n=2).json()["choices"]) == 4  # 4 engine requests: at the cap
    _error(_complete(http, prompt=["a", "b"], n=3), 400, None, "--max-queued-requests")  # 6 > 4: never fits
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as other:
        with http.stream("POST", "/v1/completions", json={**LONG, "n": 2}) as stream:
            assert stream.status_code == 200
            lines = _until_both_choices_stream(stream)
            error = _error(_complete(other, n=3), 503, None)  # 2 + 3 > 4
            assert error["code"] == "server_overloaded" and next(lines) is not None


def test_a_request_waiting_past_the_queue_time_gets_503(server, http):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as other:
        with http.stream("POST", "/v1/completions", json={**LONG, "n": 2}) as stream:  # both sequence slots
            assert stream.status_code == 200
            lines = _until_both_choices_stream(stream)
            response = _complete(other, max_tokens=1)
            error = _error(response, 503, None)
            assert error["code"] == "queue_timeout" and "--max-queue-time-s" in error["message"]
            assert int(response.headers["Retry-After"]) >= 1 and next(lines) is not None


def _slow_body(port: int, stop: threading.Event, sent: list) -> None:
    body = b'{"prompt": "Once", "max_tokens": 1, "user": "' + b"s" * 200 + b'"}'
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        for byte in body[:-1]:
            if stop.is_set():
                return
            sock.sendall(bytes([byte]))
            sent.append(byte)
            time.sleep(0.05)


def test_slow_body_and_500_idle_connections_do_not_starve_a_normal_request(server, http):
    stop, sent = threading.Event(), []
    slow = threading.Thread(target=_slow_body, args=(server.port, stop, sent), daemon=True)
    slow.start()
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(500)]
    try:
        while not sent:
            time.sleep(0.01)
        response = _complete(http, max_tokens=4)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] is not None
        assert slow.is_alive()  # the slow client was still sending meanwhile
    finally:
        stop.set()
        for sock in idle:
            sock.close()
        slow.join(timeout=30)


def test_connection_cap_refuses_without_reading_the_body(server, http):
    stops, threads = [], []
    for _ in range(3):  # three slow bodies hold every request slot of --max-concurrent-connections 3
        stop, sent = threading.Event(), []
        thread = threading.Thread(target=_slow_body, args=(server.port, stop, sent), daemon=True)
        thread.start()
        stops.append(stop)
        threads.append((thread, sent))
    try:
        for _, sent in threads:
            while not sent:
                time.sleep(0.01)
        time.sleep(0.2)  # their headers are parsed: the ASGI calls are in progress
        with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=30) as other:
            response = _complete(other)
        _error(response, 503, None, "--max-concurrent-connections")
        assert response.json()["error"]["code"] == "too_many_connections"
    finally:
        for stop in stops:
            stop.set()
        for thread, _ in threads:
            thread.join(timeout=30)
    deadline = time.monotonic() + 30
    while _complete(http).status_code == 503 and time.monotonic() < deadline:
        time.sleep(0.2)  # the closed slots free as the server notices the closed sockets
    assert _complete(http).status_code == 200
