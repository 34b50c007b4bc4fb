"""bench/cpu_peers.py's tables: median round, tokens check, target ratios (pure helpers, no servers).

The targets are issue 18's: single stream >= 1.0x llama.cpp, 16 concurrent >= 1.15x
llama.cpp, 64 at once >= 1.3x vLLM, SmolLM2 Q4_1 single stream >= 0.8x llama.cpp.
"""

from __future__ import annotations

from trillium.benchmarks import cpu_peers_report as report


def _round(tok_s: float, got: int = 128, asked: int = 128, usage: bool = True) -> dict:
    return {"tok_s": tok_s, "itl_ms_mean": 1000 / tok_s, "itl_ms_p50": 900 / tok_s, "completion_tokens": got,
            "expected_completion_tokens": asked, "usage_reported": usage}


def _entry(*rounds: dict) -> dict:
    return {"rounds": list(rounds), "median": report.median_round(list(rounds))}


def test_median_round_is_the_middle_tok_s():
    rounds = [_round(30.0), _round(10.0), _round(20.0)]
    assert report.median_round(rounds)["tok_s"] == 20.0
    assert report.median_round([_round(10.0), _round(20.0)])["tok_s"] == 20.0


def test_tokens_check_names_a_short_server_and_uncounted_usage():
    assert report.tokens_check([_round(1.0), _round(2.0)]) == "ok 256/256"
    assert report.tokens_check([_round(1.0, got=100)]).startswith("SHORT 100/128")
    assert "text chunks counted" in report.tokens_check([_round(1.0, usage=False)])


def test_targets_ratio_met_and_missing_peer():
    results = {
        report.TRILLIUM: {"single": _entry(_round(60.0)), "mixed16": _entry(_round(200.0)),
                          "all64": _entry(_round(390.0))},
        report.LLAMA_CPP: {"single": _entry(_round(150.0)), "mixed16": _entry(_round(160.0))},
    }
    rows = {r["workload"]: r for r in report.target_rows(results)}
    assert abs(rows["single"]["ratio"] - 0.4) < 1e-9 and rows["single"]["met"] is False
    assert abs(rows["mixed16"]["ratio"] - 1.25) < 1e-9 and rows["mixed16"]["met"] is True
    assert rows["all64"]["ratio"] is None and rows["all64"]["met"] is None  # vLLM not run
    skipped = {report.VLLM: "skipped: no --vllm-python PATH"}
    targets = report.format_targets(results, skipped)
    assert "0.40x" in targets and "NO" in targets and "1.25x" in targets
    assert "n/a (skipped: no --vllm-python PATH)" in targets
    table = report.format_results(results, skipped)
    assert "skipped: no --vllm-python PATH" in table and "60.0" in table and "ok 128/128" in table


def test_baseline_rows_and_ratio_only_where_both_ran():
    """--baseline: Trillium with its default flags beside Trillium with --trillium-arg, same run."""
    results = {
        report.TRILLIUM: {"single": _entry(_round(150.0)), "mixed16": _entry(_round(450.0))},
        report.BASELINE: {"single": _entry(_round(100.0))},
        report.LLAMA_CPP: {"single": _entry(_round(140.0))},
    }
    table = report.format_results(results, {})
    single_rows = [line for line in table.splitlines() if line.startswith("bench: one stream")]
    assert [line.split()[3] for line in single_rows] == ["trillium", "llama.cpp", "vllm", "baseline"]
    assert not any("baseline" in line for line in table.splitlines() if line.startswith("bench: mixed"))
    lines = report.format_baseline(results).splitlines()
    assert len(lines) == 2 and lines[1].startswith("bench: one stream") and lines[1].endswith("1.50x")
    assert report.format_baseline({report.TRILLIUM: results[report.TRILLIUM]}) == ""
    assert {r["workload"]: r["ratio"] for r in report.target_rows(results)}["single"] == 150.0 / 140.0
