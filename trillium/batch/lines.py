"""The lines of a batch file: parsing the input, writing the output, resuming (pure, no I/O).

Input: OpenAI's batch format, one JSON object a line,

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Output: one JSON object a line, OpenAI's batch output (and vLLM's run_batch.py
BatchRequestOutput):

    {"id": "batch_req_<hex>", "custom_id": "req-1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

A line the route answered with an error keeps the route's status and body in
`response` and sets `error` to the body's {"code", "message"}; a line that
never reached a route (not JSON, a missing field, a streamed body, a
duplicate custom_id) has `response: null` and `error` {"code", "message"},
the message naming the line. `error` is null exactly when the line succeeded
(a 2xx), so readers may filter on it alone.

Resuming: `resume_state(existing_output_text)` keeps the output's successful
lines (their custom_ids are done and skipped); its error lines and a torn
last line are dropped, so those lines run again.

State: `CustomIds` remembers which custom_ids are done and which this run
has already seen (a second line with one is that line's error).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any

import attrs

# The fields of an input line (OpenAI's batch input): anything else is that line's error.
LINE_FIELDS = ("custom_id", "method", "url", "body")

# error codes of lines that never reached a route
INVALID_LINE = "invalid_batch_line"
DUPLICATE_ID = "duplicate_custom_id"


@attrs.frozen
class BatchRequest:
    """One input line to run: POST `path` (query string apart) with the JSON `body`."""

    line_number: int  # 1-based, as editors count
    custom_id: str
    path: str
    query: str
    body: dict[str, Any]


@attrs.frozen
class LineError:
    """An input line that cannot run; custom_id None when the line does not say one."""

    line_number: int
    custom_id: str | None
    code: str
    message: str

    def record(self) -> dict[str, Any]:
        return {"id": new_record_id(), "custom_id": self.custom_id, "response": None,
                "error": {"code": self.code, "message": f"line {self.line_number}: {self.message}"}}


def new_record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def parse_line(text: str, line_number: int) -> BatchRequest | LineError:
    """One input line (without its newline) as a request to run, or why it cannot run."""
    try:
        line = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return LineError(line_number, None, INVALID_LINE, f"not valid JSON ({exc})")
    if not isinstance(line, dict):
        return LineError(line_number, None, INVALID_LINE, f"expected a JSON object, got {type(line).__name__}")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(line_number, None, INVALID_LINE, "custom_id: a non-empty string is required")

    def bad(message: str) -> LineError:
        return LineError(line_number, custom_id, INVALID_LINE, message)

    unknown = sorted(set(line) - set(LINE_FIELDS))
    if unknown:
        return bad(f"unknown field(s) {', '.join(unknown)}: a line has only {', '.join(LINE_FIELDS)}")
    if line.get("method") != "POST":
        return bad(f"method: only \"POST\" is supported, got {line.get('method')!r}")
    url = line.get("url")
    if not isinstance(url, str) or not url.startswith("/"):
        return bad(f"url: a path on the server such as /v1/chat/completions is required, got {url!r}")
    body = line.get("body")
    if not isinstance(body, dict):
        return bad(f"body: a JSON object is required, got {type(body).__name__}")
    # WHY refused here: a batch line's output is one JSON body; an SSE stream has no place in it.
    if body.get("stream") not in (None, False):
        return bad("body.stream: batch lines are not streamed; drop `stream` or set it to false")
    path, _, query = url.partition("?")
    return BatchRequest(line_number, custom_id, path, query, body)


def response_record(custom_id: str, status: int, request_id: str, body: Any) -> dict[str, Any]:
    """The output line of a request a route answered (any status)."""
    error = None
    if not 200 <= status < 300:
        detail = body.get("error") if isinstance(body, dict) else None
        if not isinstance(detail, dict):
            detail = {"message": str(body)}
        code = detail.get("code") if detail.get("code") is not None else detail.get("type", status)
        error = {"code": code, "message": detail.get("message", "")}
    return {"id": new_record_id(), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": error}


def is_done(record: Any) -> bool:
    """Whether an output line is a success (its custom_id needs no rerun)."""
    if not isinstance(record, dict) or record.get("error") is not None:
        return False
    response = record.get("response")
    return (isinstance(record.get("custom_id"), str) and isinstance(response, dict)
            and isinstance(response.get("status_code"), int) and 200 <= response["status_code"] < 300)


@attrs.frozen
class ResumeState:
    kept_lines: tuple[str, ...]  # the successful output lines, as they were (newline not included)
    done_ids: frozenset[str]
    num_dropped: int  # error lines and unreadable (torn) lines of the old output


def resume_state(lines: Iterable[str]) -> ResumeState:
    """What a rerun keeps of an existing output file's lines."""
    kept: list[str] = []
    done: set[str] = set()
    dropped = 0
    for line in lines:
        text = line.rstrip("\n")
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            record = None
        if is_done(record) and record["custom_id"] not in done:
            kept.append(text)
            done.add(record["custom_id"])
        else:
            dropped += 1
    return ResumeState(tuple(kept), frozenset(done), dropped)


class CustomIds:
    """Which custom_ids this run skips (done before) and which it has already taken."""

    def __init__(self, done: frozenset[str] = frozenset()) -> None:
        self._done = done
        self._seen: dict[str, int] = {}  # custom_id -> line number of its first line

    def classify(self, request: BatchRequest) -> str | LineError:
        """"skip" (done in an earlier run), "run", or the LineError of a duplicate custom_id."""
        first = self._seen.get(request.custom_id)
        if first is not None:
            return LineError(request.line_number, request.custom_id, DUPLICATE_ID,
                             f"custom_id {request.custom_id!r} was already used on line {first}")
        self._seen[request.custom_id] = request.line_number
        return "skip" if request.custom_id in self._done else "run"
