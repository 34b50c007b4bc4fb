"""Batch-file lines without the engine: parsing, output records, resuming, duplicate ids, paths.

The formats are OpenAI's batch input / output lines as vLLM reads and writes
them: vllm-project/vllm vllm/entrypoints/openai/run_batch.py (BatchRequestInput:
custom_id, method, url, body; BatchRequestOutput: id, custom_id, response
{status_code, request_id, body}, error).
"""

from __future__ import annotations

import json

import pytest

from trillium.batch.lines import (
    DUPLICATE_ID,
    INVALID_LINE,
    BatchRequest,
    CustomIds,
    LineError,
    is_done,
    parse_line,
    resume_state,
    response_record,
)
from trillium.batch.runner import BatchOptions, prepare_files

CHAT = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}


def _line(**changes) -> str:
    line = {**CHAT, **changes}
    return json.dumps({k: v for k, v in line.items() if v is not None})


def test_a_good_line_is_a_request():
    request = parse_line(_line(url="/v1/completions?x=1"), 3)
    assert request == BatchRequest(3, "a", "/v1/completions", "x=1", CHAT["body"])
    assert parse_line(_line().encode(), 1).path == "/v1/chat/completions"  # bytes as read from the file


@pytest.mark.parametrize("text, custom_id, words", [
    ("{not json", None, "not valid JSON"),
    (b"\xff\xfe{", None, "not valid JSON"),
    ("[1, 2]", None, "expected a JSON object"),
    (_line(custom_id=None), None, "custom_id"),
    (_line(custom_id=7), None, "custom_id"),
    (_line(method="GET"), "a", "method"),
    (_line(method=None), "a", "method"),
    (_line(url="v1/completions"), "a", "url"),
    (_line(url=None), "a", "url"),
    (_line(body=[1]), "a", "body"),
    (_line(body={"prompt": "x", "stream": True}), "a", "body.stream"),
    (json.dumps({**CHAT, "priority": 1}), "a", "unknown field(s) priority"),
])
def test_a_bad_line_is_that_lines_error(text, custom_id, words):
    error = parse_line(text, 9)
    assert isinstance(error, LineError) and error.code == INVALID_LINE
    assert error.custom_id == custom_id and words in error.message
    record = error.record()
    assert record["response"] is None and record["custom_id"] == custom_id
    assert record["error"]["message"].startswith("line 9: ") and record["id"].startswith("batch_req_")


def test_stream_false_is_fine():
    assert isinstance(parse_line(_line(body={"prompt": "x", "stream": False}), 1), BatchRequest)


def test_response_records_carry_the_routes_status_and_error():
    ok = response_record("a", 200, "chatcmpl-1", {"choices": []})
    assert ok["response"] == {"status_code": 200, "request_id": "chatcmpl-1", "body": {"choices": []}}
    assert ok["error"] is None and is_done(ok)
    body = {"error": {"message": "max_tokens: must be at least 1", "type": "invalid_request_error",
                      "param": "max_tokens", "code": None}}
    bad = response_record("b", 400, "r", body)
    assert bad["response"]["body"] == body and bad["response"]["status_code"] == 400
    assert bad["error"] == {"code": "invalid_request_error", "message": "max_tokens: must be at least 1"}
    assert not is_done(bad)
    coded = response_record("c", 503, "r", {"error": {"message": "busy", "type": "x", "code": "overloaded"}})
    assert coded["error"]["code"] == "overloaded"


def test_resume_keeps_successes_and_drops_errors_and_torn_lines():
    ok = json.dumps(response_record("a", 200, "r", {"x": 1}))
    ok_again = json.dumps(response_record("a", 200, "r", {"x": 2}))
    failed = json.dumps(response_record("b", 400, "r", {"error": {"message": "no", "type": "t"}}))
    refused = json.dumps(LineError(3, "c", INVALID_LINE, "bad").record())
    state = resume_state([ok + "\n", "\n", failed + "\n", refused + "\n", ok_again + "\n", '{"id": "batch_req'])
    assert state.kept_lines == (ok,) and state.done_ids == {"a"} and state.num_dropped == 4


def test_custom_ids_skip_done_ones_and_refuse_duplicates():
    ids = CustomIds(frozenset({"done"}))
    first = parse_line(_line(custom_id="x"), 1)
    assert ids.classify(first) == "run"
    assert ids.classify(parse_line(_line(custom_id="done"), 2)) == "skip"
    duplicate = ids.classify(parse_line(_line(custom_id="x"), 5))
    assert isinstance(duplicate, LineError) and duplicate.code == DUPLICATE_ID
    assert duplicate.custom_id == "x" and "line 1" in duplicate.message
    assert isinstance(ids.classify(parse_line(_line(custom_id="done"), 6)), LineError)


def test_prepare_files_refuses_urls_and_missing_paths(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(_line() + "\n\n" + _line(custom_id="b") + "\n")
    for given in (BatchOptions("https://example.com/in.jsonl", str(tmp_path / "o"), 4),
                  BatchOptions(str(source), "http://example.com/out.jsonl", 4)):
        with pytest.raises(ValueError, match="only local paths"):
            prepare_files(given)
    with pytest.raises(ValueError, match="no such file"):
        prepare_files(BatchOptions(str(tmp_path / "missing.jsonl"), str(tmp_path / "o"), 4))
    with pytest.raises(ValueError, match="does not exist"):
        prepare_files(BatchOptions(str(source), str(tmp_path / "nodir" / "o"), 4))
    with pytest.raises(ValueError, match="is the input file"):
        prepare_files(BatchOptions(str(source), str(source), 4))
    files = prepare_files(BatchOptions(str(source), str(tmp_path / "new.jsonl"), 4))
    assert files.num_lines == 2 and not files.resume.done_ids


def test_prepare_files_rewrites_the_output_to_its_successes(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(_line() + "\n")
    out = tmp_path / "out.jsonl"
    ok = json.dumps(response_record("a", 200, "r", {"x": 1}))
    out.write_text(ok + "\n" + json.dumps(LineError(2, "b", INVALID_LINE, "bad").record()) + "\n{torn")
    files = prepare_files(BatchOptions(str(source), str(out), 4))
    assert files.resume.done_ids == {"a"} and files.resume.num_dropped == 2
    assert out.read_text() == ok + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]  # no scratch file left


def test_run_batch_help_and_refused_vllm_flags():
    from trillium.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if hasattr(a, "choices") and a.choices and "run-batch" in a.choices)
    batch = sub.choices["run-batch"]
    # WHY the help strings, not format_help(): argparse wraps lines at hyphens
    text = " ".join([batch.description, *(a.help or "" for a in batch._actions), *batch._option_string_actions])
    for words in ("--input-file", "--output-file", "Resumable", "--max-concurrency", "2 x --max-num-seqs",
                  "--tool-call-parser", "--max-num-seqs"):
        assert words in text, words
    args = parser.parse_args(["run-batch", "-i", "a", "-o", "b", "--model", "m"])
    assert (args.input_file, args.output_file, args.max_concurrency, args.progress) == ("a", "b", 0, True)
    with pytest.raises(SystemExit):  # vLLM's URL upload staging dir: there are no URL outputs here
        parser.parse_args(["run-batch", "-i", "a", "-o", "b", "--model", "m", "--output-tmp-dir", "/tmp"])
