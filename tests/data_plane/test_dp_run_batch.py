"""`trillium run-batch` end to end: one real CLI process over a file of good and bad lines.

Mirrors `vllm run-batch` (vllm-project/vllm vllm/entrypoints/openai/run_batch.py):
-i/--input-file and -o/--output-file, OpenAI's batch lines in
({custom_id, method, url, body}) and out ({id, custom_id, response
{status_code, request_id, body}, error}), at most 2 x max_num_seqs lines in
flight by default, a progress bar. Beyond it: a bad line (not JSON, a
streamed body, a duplicate custom_id, an unknown url, a 400 from the route)
is that line's error and never stops the file, and the output resumes.

The oracle is the server itself: the same bodies POSTed to the in-process
data-plane harness (`dp_server`, the same checkpoint) answer the same greedy
text. Resuming is shown within the one run: the output file already holds a
successful line (kept as it was, its custom_id not run again), an error line
and a torn line (both dropped, the errored custom_id run again).
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from support.data_plane_server import MODEL_NAME

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 6, "temperature": 0}
CHAT_NO_MODEL = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5, "temperature": 0}
COMPLETION = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}


def _line(custom_id: str, url: str, body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_run_batch_cli_good_and_bad_lines_and_resume(dp_server, checkpoint, tmp_path):
    path = checkpoint("llama", max_position_embeddings=2048)  # dp_server's checkpoint
    source = tmp_path / "requests.jsonl"
    source.write_text("\n".join([
        _line("chat", "/v1/chat/completions", CHAT),                                       # 1
        _line("completion", "/v1/completions", COMPLETION),                                # 2
        '{"custom_id": "broken", "method": "POST", ',                                      # 3 not JSON
        _line("nowhere", "/v1/nope", COMPLETION),                                          # 4 unknown url
        _line("too-hot", "/v1/completions", {**COMPLETION, "temperature": -1}),            # 5 a 400
        _line("chat", "/v1/completions", COMPLETION),                                      # 6 duplicate
        _line("streamed", "/v1/completions", {**COMPLETION, "stream": True}),              # 7
        "",                                                                                # blank: skipped
        _line("chat-default-model", "/v1/chat/completions", CHAT_NO_MODEL),                # 9
        _line("done-before", "/v1/completions", COMPLETION),                               # 10 resumed: skipped
        _line("failed-before", "/v1/completions", COMPLETION),                             # 11 resumed: rerun
    ]) + "\n")
    out = tmp_path / "results.jsonl"
    done = {"id": "batch_req_old", "custom_id": "done-before", "error": None,
            "response": {"status_code": 200, "request_id": "cmpl-old", "body": {"sentinel": True}}}
    failed = {"id": "batch_req_failed", "custom_id": "failed-before", "response": None,
              "error": {"code": "x", "message": "engine went away"}}
    out.write_text(json.dumps(done) + "\n" + json.dumps(failed) + '\n{"id": "batch_req_to')

    run = subprocess.run(
        [sys.executable, "-m", "trillium.cli", "run-batch", "-i", str(source), "-o", str(out),
         "--model", str(path), "--served-model-name", MODEL_NAME, "--executor-threads", "1",
         "--max-num-seqs", "8", "--kv-cache-memory", "16MiB", "--max-concurrency", "3"],
        capture_output=True, text=True, timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "run-batch: 4 succeeded, 5 failed, 1 skipped" in run.stderr, run.stderr[-3000:]
    assert "run-batch: 100%" in run.stderr and "10/10" in run.stderr  # the progress bar's last state

    records = _records(out)
    assert records[0] == done  # kept as it was, first; the torn line and the old error are gone
    assert all(set(r) == {"id", "custom_id", "response", "error"} for r in records)
    by_id: dict = {}
    for record in records:
        by_id.setdefault(record["custom_id"], []).append(record)
    assert sorted(by_id, key=str) == sorted(["done-before", "chat", "completion", None, "nowhere", "too-hot",
                                             "streamed", "chat-default-model", "failed-before"], key=str)
    assert len(records) == 10  # one per non-blank line (the duplicate "chat" is its own error line)

    async with httpx.AsyncClient(base_url=dp_server.url(), timeout=60) as http:
        for custom_id, url, body, text_of in (
                ("chat", "/v1/chat/completions", CHAT, lambda b: b["choices"][0]["message"]["content"]),
                ("chat-default-model", "/v1/chat/completions", CHAT_NO_MODEL,
                 lambda b: b["choices"][0]["message"]["content"]),
                ("completion", "/v1/completions", COMPLETION, lambda b: b["choices"][0]["text"]),
                ("failed-before", "/v1/completions", COMPLETION, lambda b: b["choices"][0]["text"])):
            (record,) = [r for r in by_id[custom_id] if r["error"] is None]
            response = record["response"]
            assert response["status_code"] == 200 and record["id"].startswith("batch_req_")
            # the route's X-Request-Id: its id of the request, which the body's id ends with
            assert response["request_id"] and response["body"]["id"].endswith(response["request_id"])
            expected = await http.post(url, json=body)
            assert expected.status_code == 200
            assert text_of(response["body"]) == text_of(expected.json()), custom_id
            assert response["body"]["model"] == MODEL_NAME
            assert response["body"]["usage"] == expected.json()["usage"]

        (broken,) = by_id[None]
        assert broken["response"] is None and broken["error"]["code"] == "invalid_batch_line"
        assert broken["error"]["message"].startswith("line 3: not valid JSON")
        (nowhere,) = by_id["nowhere"]
        assert nowhere["response"]["status_code"] == 404 and "/v1/nope" in nowhere["error"]["message"]
        assert nowhere["response"]["body"]["error"]["type"] == "not_found_error"  # the app's own 404
        (too_hot,) = by_id["too-hot"]
        expected = await http.post("/v1/completions", json={**COMPLETION, "temperature": -1})
        assert too_hot["response"]["status_code"] == expected.status_code == 400
        assert too_hot["response"]["body"] == expected.json()  # the server's own error body
        assert too_hot["error"]["message"] == expected.json()["error"]["message"]
    duplicate = [r for r in by_id["chat"] if r["error"] is not None]
    assert [r["error"]["code"] for r in duplicate] == ["duplicate_custom_id"]
    assert duplicate[0]["error"]["message"].startswith("line 6: ") and "line 1" in duplicate[0]["error"]["message"]
    (streamed,) = by_id["streamed"]
    assert streamed["response"] is None and "stream" in streamed["error"]["message"]
