"""The step timeline's parser and arithmetic (trillium/benchmarks/timeline_report.py),
on chrome traces written the way LoopProfiler writes them (its own `_chrome_trace`)."""

from __future__ import annotations

import json
import math

import pytest

from trillium.benchmarks.timeline_report import (
    CRITICAL,
    format_table,
    load_spans,
    step_segments,
    summarize,
)
from trillium.observability.profiling import LoopProfiler

MS = 1_000_000  # ns


def _trace(tmp_path, actor: str, spans: list[tuple[str, float, float]]) -> str:
    """Spans in ms, recorded by a real LoopProfiler (timeline mode) and written by it."""
    profiler = LoopProfiler(actor)
    profiler.start(str(tmp_path), now=0.0, python_profile=False)
    for name, start, end in spans:
        profiler.record(name, int(start * MS), int(end * MS))
    files = profiler.stop()
    assert len(files) == 1 and files[0].endswith(".trace.json"), "a timeline writes no cProfile"
    return files[0]


def _step(t: float) -> tuple[list, list, list]:
    """One 10 ms decode step starting at `t` ms, then its scheduler and detokenizer work."""
    executor = [("ExecuteBatch", t, t + 8), ("inputs", t + 0.5, t + 1), ("forward", t + 1, t + 6),
                ("sample", t + 6, t + 7.5), ("result", t + 7.5, t + 7.6), ("send BatchResult", t + 8, t + 8.2)]
    scheduler = [("BatchResult", t + 8.5, t + 9), ("schedule", t + 9.2, t + 9.5),
                 ("send ExecuteBatch", t + 9.5, t + 9.7), ("send TokenDeltas", t + 9.7, t + 9.8)]
    detokenizer = [("TokenDeltas", t + 10.5, t + 11), ("send RequestOutputs", t + 11, t + 11.1)]
    return executor, scheduler, detokenizer


def _files(tmp_path, starts) -> list[str]:
    per_actor = {"executor": [], "scheduler": [], "detokenizer": []}
    for t in starts:
        for actor, spans in zip(per_actor, _step(t)):
            per_actor[actor] += spans
    files = [_trace(tmp_path / actor, actor, spans) for actor, spans in per_actor.items()]
    (tmp_path / "executor-1-x.prof").write_text("not a trace")
    return [*files, str(tmp_path / "executor-1-x.prof")]


def test_segments_add_up_to_the_period(tmp_path):
    files = _files(tmp_path, [0.0, 10.0, 20.0])
    spans = load_spans(files)
    assert set(spans) == {"executor", "scheduler", "detokenizer"}
    # Two client chunks after step 0's outputs, one after step 1's (each window ends
    # at the next step's detokenizer end), none in the last one's.
    chunks_s = [11.3e-3, 11.9e-3, 21.4e-3]
    steps = step_segments(spans, chunks_s)
    assert len(steps) == 2, "the last step has no next one: its period is unknown"
    first = steps[0]
    assert first["period"] == pytest.approx(10.0)
    assert first["executor busy"] == pytest.approx(8.0)
    assert first["executor: forward"] == pytest.approx(5.0)
    assert first["executor: torch-thread hop"] == pytest.approx(8.0 - 0.5 - 5 - 1.5 - 0.1)
    assert first["hop executor->scheduler"] == pytest.approx(0.5)
    assert first["scheduler: other (stats, drain)"] == pytest.approx(0.2)
    assert first["hop scheduler->executor"] == pytest.approx(0.5)
    assert first["unaccounted"] == pytest.approx(0.0, abs=1e-9)
    assert sum(first[key] for key in CRITICAL) == pytest.approx(first["period"])
    assert first["hop scheduler->detokenizer"] == pytest.approx(0.8)
    assert first["detokenizer: process"] == pytest.approx(0.5)
    assert first["api+SSE+client: first chunk"] == pytest.approx(0.3)
    assert first["api+SSE+client: last chunk"] == pytest.approx(0.9)
    assert first["client chunks"] == 2
    assert steps[1]["client chunks"] == 1

    summary = summarize(steps)
    assert summary["steps"] == 2 and summary["client chunks"] == pytest.approx(1.5)
    assert summary["executor: forward"] == pytest.approx(5.0)
    table = format_table({1: summary, 16: summary})
    assert "batch 16: ms" in table and "executor: forward" in table
    assert "50.0" in table, "forward is 50% of the period"


def test_missing_actor_leaves_its_segments_out(tmp_path):
    executor = []
    for t in (0.0, 10.0):
        executor += _step(t)[0]
    spans = load_spans([_trace(tmp_path, "executor", executor)])
    steps = step_segments(spans)
    assert len(steps) == 1 and "hop executor->scheduler" not in steps[0] and "unaccounted" not in steps[0]
    summary = summarize(steps)
    assert math.isnan(summary["scheduler: schedule()"])
    assert "nan" in format_table({1: summary})


def test_load_spans_reads_actor_from_thread_name(tmp_path):
    path = tmp_path / "whatever.trace.json"
    path.write_text(json.dumps({"traceEvents": [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "detokenizer"}},
        {"name": "TokenDeltas", "ph": "X", "ts": 5.0, "dur": 2.0, "pid": 1, "tid": 1},
        {"name": "TokenDeltas", "ph": "X", "ts": 1.0, "dur": 1.0, "pid": 1, "tid": 1},
    ]}))
    spans = load_spans([str(path)])
    assert [(s.start, s.end) for s in spans["detokenizer"]] == [(1.0, 2.0), (5.0, 7.0)]
