"""The batch runner's reader, line tasks and writer over a small QuartTrio app (no engine):
the concurrency bound, one output line per input line, and the records of answers that
are errors or not JSON. The engine end to end: data_plane/test_dp_run_batch.py."""

from __future__ import annotations

import json

import trio
from quart import Blueprint, jsonify, request
from quart_trio import QuartTrio

from trillium.batch.asgi_call import app_lifespan
from trillium.batch.runner import BatchOptions, _BatchRun, prepare_files


def _app(in_flight: list[int]) -> QuartTrio:
    app = QuartTrio("batch-runner-test")
    routes = Blueprint("r", __name__)

    @routes.post("/work")
    async def work():
        body = await request.get_json()
        in_flight[0] += 1
        in_flight[1] = max(in_flight[1], in_flight[0])
        await trio.sleep(0.02)
        in_flight[0] -= 1
        if body.get("fail"):
            return jsonify({"error": {"message": "no", "type": "invalid_request_error", "code": None}}), 400
        return jsonify({"echo": body["n"]}), 200, {"X-Request-Id": f"req-{body['n']}"}

    @routes.post("/text")
    async def text():
        return "plain", 200

    app.register_blueprint(routes)
    return app


def _line(custom_id, url, body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


async def test_lines_run_within_the_bound_and_each_gets_its_output_line(tmp_path):
    source = tmp_path / "in.jsonl"
    lines = [_line(f"c{n}", "/work", {"n": n}) for n in range(10)]
    lines += [_line("bad", "/work", {"n": 0, "fail": True}), _line("text", "/text", {}), "[]"]
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "x", "custom_id": "c3", "error": None,
                               "response": {"status_code": 200, "request_id": "r", "body": {"old": 1}}}) + "\n")
    options = BatchOptions(str(source), str(out), max_concurrency=3, progress=False)
    in_flight = [0, 0]
    app = _app(in_flight)
    async with app_lifespan(app):
        summary = await _BatchRun(app, options, prepare_files(options)).run()
    assert in_flight[1] == 3  # the bound was reached and never passed
    assert (summary.num_succeeded, summary.num_failed, summary.num_skipped) == (9, 3, 1)
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records["c3"]["response"]["body"] == {"old": 1}  # done before: not run again
    assert sorted(records, key=str) == sorted([f"c{n}" for n in range(10)] + ["bad", "text", None], key=str)
    assert records["c7"]["response"] == {"status_code": 200, "request_id": "req-7", "body": {"echo": 7}}
    assert records["bad"]["response"]["status_code"] == 400 and records["bad"]["error"]["message"] == "no"
    assert records["text"]["error"]["code"] == "invalid_response"
    assert "not JSON" in records["text"]["error"]["message"] and records["text"]["response"]["body"] is None
    assert records[None]["error"]["code"] == "invalid_batch_line"
