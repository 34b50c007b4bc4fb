"""Where a step's time goes: the spans of a timeline profile, step by step.

Pure (no engine, no HTTP): `bench/step_timeline.py` (trillium/benchmarks/
timeline.py) runs the engine, records a *timeline* profile
(`/start_profile {"timeline": true}`: spans only, no cProfile or
torch.profiler) and hands the files here with the client's SSE chunk
arrival times.

In: each actor's `<actor>-<pid>-<stamp>.trace.json` (chrome trace, `ts` /
`dur` in µs of perf_counter_ns, which is CLOCK_MONOTONIC on Linux and so one
clock across the engine's processes and the client's `time.perf_counter()`).
The spans it reads:

    executor     ExecuteBatch (one step, trio side, includes the torch-thread hop),
                 inside it: inputs, forward, sample, result (StageClock)
    scheduler    BatchResult (update_from_output), schedule, send TokenDeltas
    detokenizer  TokenDeltas (process)

Out: per step, the milliseconds of each segment of the *critical path* (what
the executor waits on between two steps: the rows of CRITICAL, which add up
to the step period) and of the work *beside* it (token deltas to the
detokenizer, then to the api and the client: the rows of BESIDE). Steps are
matched by time order: one step is out on the executor at a time (the
scheduler loop's INVARIANT), so the first span of a kind after a point is
that step's.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Sequence

import attrs

EXECUTOR_STAGES = ("inputs", "forward", "sample", "result")

# Segment names, in the order of one step's critical path. A hop is measured from
# the end of the sender's work to the start of the receiver's: encode, sign, the
# zmq send, the receiver's wake-up, gate and decode. (A send span's own end is no
# good bound: trio may run other tasks before the send call returns, after the
# peer has the message.)
CRITICAL = (
    "executor: inputs + metadata", "executor: forward", "executor: lm head + sampling", "executor: result build",
    "executor: torch-thread hop", "hop executor->scheduler", "scheduler: process result",
    "scheduler: other (stats, drain)", "scheduler: schedule()", "hop scheduler->executor", "unaccounted",
)
BESIDE = (
    "hop scheduler->detokenizer", "detokenizer: process", "api+SSE+client: first chunk",
    "api+SSE+client: last chunk",
)
_STAGE_SEGMENT = dict(zip(EXECUTOR_STAGES, CRITICAL[:4]))


@attrs.frozen
class Span:
    name: str
    start: float  # µs, CLOCK_MONOTONIC
    end: float


def load_spans(files: Iterable[str]) -> dict[str, list[Span]]:
    """Each actor's complete spans ("ph": "X"), sorted by start; the actor is the
    trace's thread name. Files that are not chrome traces (.prof) are skipped."""
    spans: dict[str, list[Span]] = {}
    for path in files:
        if not path.endswith(".trace.json") or path.endswith(".pt.trace.json"):
            continue
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        actor = next((e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"),
                     path.rsplit("/", 1)[-1].split("-", 1)[0])
        spans.setdefault(actor, []).extend(
            Span(e["name"], e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X")
    for actor_spans in spans.values():
        actor_spans.sort(key=lambda s: s.start)
    return spans


class _Kind:
    """One span name's spans, searchable by start time."""

    def __init__(self, spans: Sequence[Span], name: str) -> None:
        self.spans = [s for s in spans if s.name == name]
        self.starts = [s.start for s in self.spans]

    def first_after(self, t: float, before: float = math.inf) -> Span | None:
        i = bisect.bisect_left(self.starts, t)
        if i < len(self.spans) and self.spans[i].start < before:
            return self.spans[i]
        return None

    def inside(self, outer: Span) -> list[Span]:
        lo = bisect.bisect_left(self.starts, outer.start)
        hi = bisect.bisect_right(self.starts, outer.end)
        return [s for s in self.spans[lo:hi] if s.end <= outer.end]


def step_segments(spans: dict[str, list[Span]], chunk_times_s: Sequence[float] = ()) -> list[dict[str, float]]:
    """One dict per executor step that has a next step (its period is known):
    "period" and "executor busy" plus each segment of CRITICAL and BESIDE that
    could be matched, in ms; "client chunks" counts the SSE chunks that
    arrived in the step's api window."""
    ex, sc, de = (spans.get(a, []) for a in ("executor", "scheduler", "detokenizer"))
    steps = _Kind(ex, "ExecuteBatch").spans
    stages = {name: _Kind(ex, name) for name in EXECUTOR_STAGES}
    sc_result, sc_schedule = _Kind(sc, "BatchResult"), _Kind(sc, "schedule")
    beside = (_Kind(sc, "send TokenDeltas"), sc_result, _Kind(de, "TokenDeltas"))
    chunks = sorted(t * 1e6 for t in chunk_times_s)
    out = []
    for step, following in zip(steps, steps[1:]):
        seg = {"period": following.start - step.start, "executor busy": step.end - step.start}
        staged = 0.0
        for name, kind in stages.items():
            inner = kind.inside(step)
            if inner:
                seg[_STAGE_SEGMENT[name]] = sum(s.end - s.start for s in inner)
                staged += seg[_STAGE_SEGMENT[name]]
        if staged:
            seg["executor: torch-thread hop"] = step.end - step.start - staged
        result = sc_result.first_after(step.end, following.start)
        if result is not None:
            seg["hop executor->scheduler"] = result.start - step.end
            seg["scheduler: process result"] = result.end - result.start
            _next_batch(seg, result, following, sc_schedule)
            _beside(seg, result, *beside, chunks)
        if all(key in seg for key in CRITICAL[:-1]):
            seg["unaccounted"] = seg["period"] - sum(seg[key] for key in CRITICAL[:-1])
        count = seg.pop("client chunks", None)
        row = {k: v / 1e3 for k, v in seg.items()}  # µs -> ms
        if count is not None:
            row["client chunks"] = count
        out.append(row)
    return out


def _next_batch(seg: dict, result: Span, following: Span, schedule_kind: _Kind) -> None:
    """result processed -> schedule() -> (send) -> the next step starts."""
    schedule = schedule_kind.first_after(result.end, following.start)
    if schedule is not None:
        seg["scheduler: other (stats, drain)"] = schedule.start - result.end
        seg["scheduler: schedule()"] = schedule.end - schedule.start
        seg["hop scheduler->executor"] = following.start - schedule.end


def _beside(seg: dict, result: Span, send_deltas: _Kind, results: _Kind, process: _Kind,
            chunks: list[float]) -> None:
    """The step's token deltas: scheduler -> detokenizer -> api -> client."""
    next_result = results.first_after(result.end)
    sent = send_deltas.first_after(result.end, next_result.start if next_result is not None else math.inf)
    detok = process.first_after(sent.start) if sent is not None else None
    if detok is None:
        return
    seg["hop scheduler->detokenizer"] = detok.start - sent.start
    seg["detokenizer: process"] = detok.end - detok.start
    # The api's window: from this step's outputs to the next step's.
    following = process.first_after(detok.end)
    lo = bisect.bisect_left(chunks, detok.end)
    hi = bisect.bisect_left(chunks, following.end) if following is not None else lo
    if hi > lo:
        seg["api+SSE+client: first chunk"] = chunks[lo] - detok.end
        seg["api+SSE+client: last chunk"] = chunks[hi - 1] - detok.end
        seg["client chunks"] = hi - lo


def summarize(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """The mean of each key over the steps that have it (NaN for none)."""
    keys = ("period", "executor busy", *CRITICAL, *BESIDE, "client chunks")
    means = {}
    for key in keys:
        values = [s[key] for s in steps if key in s]
        means[key] = sum(values) / len(values) if values else math.nan
    means["steps"] = len(steps)
    return means


def format_table(results: dict[int, dict[str, float]]) -> str:
    """Batch size -> summary, as one text table: ms per step and % of the step period."""
    batches = sorted(results)
    head = f"{'segment (mean per step)':<36}" + "".join(f"{f'batch {b}: ms':>16}{'%':>6}" for b in batches)
    lines = [head, "-" * len(head)]

    def row(label: str, key: str, share: bool = True) -> str:
        cells = []
        for b in batches:
            value, period = results[b][key], results[b]["period"]
            pct = f"{100 * value / period:>6.1f}" if share and period and not math.isnan(value) else f"{'':>6}"
            cells.append(f"{value:>16.3f}{pct}")
        return f"{label:<36}" + "".join(cells)

    lines.append(row("step period", "period"))
    lines.append(row("  executor busy (ExecuteBatch)", "executor busy"))
    lines.append("critical path (the executor waits on it):")
    lines += [row("  " + key, key) for key in CRITICAL]
    lines.append("beside it (overlaps the next step):")
    lines += [row("  " + key, key) for key in BESIDE]
    lines.append(f"{'per output token (period / batch)':<36}"
                 + "".join(f"{results[b]['period'] / b:>16.3f}{'':>6}" for b in batches))
    lines.append(f"{'client chunks per step (expect = batch)':<36}"
                 + "".join(f"{results[b]['client chunks']:>16.1f}{'':>6}" for b in batches))
    lines.append(f"{'steps measured':<36}" + "".join(f"{results[b]['steps']:>16d}{'':>6}" for b in batches))
    return "\n".join(lines)
