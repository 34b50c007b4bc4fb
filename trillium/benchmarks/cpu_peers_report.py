"""Tables of bench/cpu_peers.py: Trillium beside llama.cpp and vLLM, and issue 18's targets.

Role: pure formatting of the results `trillium.benchmarks.cpu_peers` gathered,
no I/O. In: `results[server][workload] = {"rounds": [summary, ...], "median":
summary}` where a summary is `openai_client.summarize`'s dict, and the
servers that were skipped (label -> why). Out: the issue's table (tok/s with
the rounds' range, ITL mean/p50, whether every token asked came back) and
the targets' table (Trillium's tok/s over the peer's, beside the threshold).
"""

from __future__ import annotations

import attrs

TRILLIUM, LLAMA_CPP, VLLM = "trillium", "llama.cpp", "vllm"
SERVERS = (TRILLIUM, LLAMA_CPP, VLLM)
# cpu_peers.py --baseline: `trillium serve` again with its default flags (without --trillium-arg),
# so a flag's effect is printed beside it in the same run.
BASELINE = "baseline"


@attrs.frozen
class Workload:
    key: str
    title: str
    model: str  # "bench" (float32, 31.6M) or "smollm2" (the default model's Q4_1 GGUF)
    shape: str  # "fixed": prompt 128 / 128 out; "mixed": prompts 32-512, outputs 16-256
    servers: tuple[str, ...] = SERVERS  # the SmolLM2 target compares with llama.cpp only


WORKLOADS = (
    Workload("single", "bench: one stream", "bench", "fixed"),
    Workload("mixed16", "bench: mixed, 16 concurrent", "bench", "mixed"),
    Workload("all64", "bench: the mixed requests all at once", "bench", "mixed"),
    Workload("smol_single", "SmolLM2-135M Q4_1: one stream", "smollm2", "fixed", (TRILLIUM, LLAMA_CPP)),
)


@attrs.frozen
class Target:
    workload: str
    peer: str
    at_least: float


# Issue 18, item 5: Trillium's tok/s over the peer's on the same workload.
TARGETS = (
    Target("single", LLAMA_CPP, 1.0),
    Target("mixed16", LLAMA_CPP, 1.15),
    Target("all64", VLLM, 1.3),
    Target("smol_single", LLAMA_CPP, 0.8),
)


def median_round(rounds: list[dict]) -> dict:
    """The round with the median tok/s (the upper one of an even count, as compare.py picks)."""
    ordered = sorted(rounds, key=lambda r: r["tok_s"])
    return ordered[len(ordered) // 2]


def tokens_check(rounds: list[dict]) -> str:
    """'ok' when every round got every token asked (ignore_eos honoured), else what was short."""
    got = sum(r["completion_tokens"] for r in rounds)
    asked = sum(r["expected_completion_tokens"] for r in rounds)
    counted = "" if all(r["usage_reported"] for r in rounds) else " (no usage: text chunks counted)"
    if got == asked:
        return f"ok {got}/{asked}{counted}"
    return f"SHORT {got}/{asked}{counted}"


def ratio(results: dict, target: Target) -> float | None:
    """Trillium's median tok/s over the peer's on the target's workload; None when either is missing."""
    ours = results.get(TRILLIUM, {}).get(target.workload)
    theirs = results.get(target.peer, {}).get(target.workload)
    if not ours or not theirs or not theirs["median"]["tok_s"]:
        return None
    return ours["median"]["tok_s"] / theirs["median"]["tok_s"]


def _tok_s_range(rounds: list[dict]) -> str:
    values = [r["tok_s"] for r in rounds]
    if len(values) == 1:
        return ""
    return f"{min(values):.1f}-{max(values):.1f}"


def format_results(results: dict, skipped: dict[str, str]) -> str:
    """One row per workload and server: median round's tok/s (range over rounds), ITL mean/p50, tokens."""
    lines = [f"{'workload':<40}{'server':<11}{'tok/s':>8}{'range':>13}{'ITL mean':>10}{'ITL p50':>9}  tokens"]
    for w in WORKLOADS:
        extra = (BASELINE,) if TRILLIUM in w.servers and w.key in results.get(BASELINE, {}) else ()
        for server in (*w.servers, *extra):
            entry = results.get(server, {}).get(w.key)
            if entry is None:
                why = skipped.get(server) or "not run on this workload"
                lines.append(f"{w.title:<40}{server:<11}{'-':>8}  ({why})")
                continue
            m = entry["median"]
            lines.append(f"{w.title:<40}{server:<11}{m['tok_s']:>8.1f}{_tok_s_range(entry['rounds']):>13}"
                         f"{m['itl_ms_mean']:>10.1f}{m['itl_ms_p50']:>9.1f}  {tokens_check(entry['rounds'])}")
    return "\n".join(lines)


def target_rows(results: dict) -> list[dict]:
    """Each target with its measured ratio (None: not measured) and whether it is met."""
    rows = []
    for t in TARGETS:
        r = ratio(results, t)
        rows.append({"workload": t.workload, "peer": t.peer, "at_least": t.at_least, "ratio": r,
                     "met": None if r is None else r >= t.at_least})
    return rows


def format_targets(results: dict, skipped: dict[str, str]) -> str:
    titles = {w.key: w.title for w in WORKLOADS}
    lines = [f"{'target':<40}{'vs':<11}{'ratio':>7}{'needed':>9}  met"]
    for row in target_rows(results):
        if row["ratio"] is None:
            why = skipped.get(row["peer"]) or skipped.get(TRILLIUM) or "not measured"
            lines.append(f"{titles[row['workload']]:<40}{row['peer']:<11}{'-':>7}{row['at_least']:>8.2f}x  "
                         f"n/a ({why})")
            continue
        lines.append(f"{titles[row['workload']]:<40}{row['peer']:<11}{row['ratio']:>6.2f}x{row['at_least']:>8.2f}x"
                     f"  {'yes' if row['met'] else 'NO'}")
    return "\n".join(lines)


def format_baseline(results: dict) -> str:
    """Trillium (with --trillium-arg) over its baseline (default flags) per workload; "" without a baseline."""
    rows = [(w.title, results[TRILLIUM][w.key]["median"]["tok_s"] / results[BASELINE][w.key]["median"]["tok_s"])
            for w in WORKLOADS
            if w.key in results.get(TRILLIUM, {}) and w.key in results.get(BASELINE, {})
            and results[BASELINE][w.key]["median"]["tok_s"]]
    if not rows:
        return ""
    lines = [f"{'trillium over its baseline (default flags)':<51}{'ratio':>7}"]
    lines += [f"{title:<51}{value:>6.2f}x" for title, value in rows]
    return "\n".join(lines)
