"""`trillium bench serving --base-url URL` against a real Trillium data plane on loopback.

The flags mirror vLLM's `vllm bench serve` (vllm-project/vllm, vllm/benchmarks/serve.py:
--base-url, --model, --endpoint, --num-prompts, --request-rate, --max-concurrency,
--tokenizer, --random-input-len, --random-output-len, --save-result, --result-filename,
--seed) and, like it, percentiles interpolate linearly between ranks (np.percentile).
The server is the in-process harness (support/data_plane_server.py): real HTTP, a real
engine, the tiny 512-token-vocabulary Llama, a few requests of a few tokens each.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from support.data_plane_server import API_KEY, MODEL_NAME
from trillium.benchmarks import compare
from trillium.benchmarks.openai_client import RequestTiming, percentile, summarize
from trillium.benchmarks.serving import main as serving_main
from trillium.benchmarks.throughput import _workload_mixed

TINY = ["--workload", "fixed", "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "5",
        "--vocab-size", "512", "--num-warmups", "1"]


def _saved(tmp_path, argv, capsys):
    path = tmp_path / "result.json"
    assert serving_main([*argv, "--save-result", str(path)]) == 0
    out = capsys.readouterr().out
    return json.loads(path.read_text()), out


def test_one_server_numbers_match_what_was_sent(dp_server, tmp_path, capsys):
    result, out = _saved(tmp_path, ["--base-url", dp_server.url(), *TINY], capsys)
    (server,) = result["servers"]
    assert server["model"] == MODEL_NAME  # the first id of GET /v1/models
    m = server["median"]
    assert m["num_requests"] == 3
    assert m["completion_tokens"] == m["expected_completion_tokens"] == 15  # 3 x max_tokens 5, ignore_eos
    assert m["usage_reported"]
    assert m["tok_s"] == pytest.approx(15 / m["duration_s"])
    assert m["req_s"] == pytest.approx(3 / m["duration_s"])
    assert 0 < m["ttft_ms_p50"] <= m["ttft_ms_p99"]
    assert 0 <= m["itl_ms_p50"] <= m["itl_ms_p99"]
    rows = out.strip().splitlines()
    assert len(rows) == 3 and rows[2].startswith("results written to")  # header, one row, the file
    assert rows[0].split()[:4] == ["server", "req/s", "tok/s", "vs"]
    assert rows[1].split()[0] == dp_server.url()
    assert float(rows[1].split()[2]) == pytest.approx(m["tok_s"], abs=0.06)


def test_two_servers_two_rows_and_the_mixed_workload(dp_server, tmp_path, capsys):
    """The same mixed-workload request (round r: trillium bench throughput's first at seed r), as text
    decoded with --tokenizer, goes to each server: one row per --label."""
    tokenizer = dp_server.model_path
    argv = ["--label", f"a={dp_server.url()}", "--label", f"b={dp_server.url('store2')}/", "--model", MODEL_NAME,
            "--workload", "mixed", "--num-prompts", "1", "--tokenizer", tokenizer, "--text-prompts",
            "--max-concurrency", "1", "--rounds", "2", "--num-warmups", "0"]
    result, out = _saved(tmp_path, argv, capsys)
    expected = _workload_mixed(512, 0)[0][1] + _workload_mixed(512, 1)[0][1]
    assert [s["label"] for s in result["servers"]] == ["a", "b"]
    for server in result["servers"]:
        assert len(server["rounds"]) == 2
        assert sum(r["completion_tokens"] for r in server["rounds"]) == expected
        assert server["median"] in server["rounds"]
    lines = out.strip().splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["server", "a", "b"]
    assert lines[3].startswith("results written to")
    assert result["config"]["request_rate"] is None  # inf is no JSON number: written as null


def test_unreachable_server_exits_1_with_a_message(dp_server, capsys):
    assert serving_main(["--base-url", dp_server.url(), "--base-url", "http://127.0.0.1:9", *TINY]) == 1
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:9" in err and "Traceback" not in err


def test_an_error_answer_exits_1_with_its_status(dp_server, capsys):
    assert serving_main(["--base-url", dp_server.url(), "--model", "no-such-model", *TINY]) == 1
    err = capsys.readouterr().err
    assert "answered HTTP 404" in err and "Traceback" not in err


def test_api_key_from_openai_api_key(dp_server, capsys, monkeypatch):
    """vllm/benchmarks/lib/endpoint_request_func.py sends OPENAI_API_KEY as the bearer token."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert serving_main(["--base-url", dp_server.url("keyed"), *TINY]) == 1
    assert "answered HTTP 401" in capsys.readouterr().err
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    assert serving_main(["--base-url", dp_server.url("keyed"), *TINY]) == 0


def test_bad_flags_are_usage_errors(capsys):
    for argv in (["--label", "nourl"], ["--base-url", "http://x", "--endpoint", "/v1/chat/completions"],
                 ["--base-url", "http://x", "--text-prompts"]):
        with pytest.raises(SystemExit) as exc:
            serving_main(argv)
        assert exc.value.code == 2


def test_plot_without_matplotlib_names_the_package(tmp_path, dp_server, capsys):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit) as exc:
            serving_main(["--base-url", "http://127.0.0.1:9", "--plot", str(tmp_path / "c.png")])
        assert exc.value.code == 2 and "matplotlib" in capsys.readouterr().err
    else:
        assert serving_main(["--base-url", dp_server.url(), *TINY, "--plot", str(tmp_path / "c.png")]) == 0
        assert (tmp_path / "c.png").stat().st_size > 0


def test_percentile_matches_numpy():
    values = [3.0, 1.0, 7.5, 2.0, 9.0, 4.25]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) != percentile([], 50)  # nan


def test_summarize_counts_usage_or_chunks():
    a = RequestTiming(start=0.0, expected_tokens=3, first_token=0.1, chunk_times=[0.1, 0.2, 0.4], end=0.4,
                      completion_tokens=3)
    b = RequestTiming(start=0.5, expected_tokens=2, first_token=0.8, chunk_times=[0.8, 0.9], end=0.9)
    s = summarize(2.0, [a, b])
    assert s["completion_tokens"] == 5 and not s["usage_reported"]  # b had no usage chunk: its chunks count
    assert s["tok_s"] == 2.5 and s["req_s"] == 1.0
    assert s["ttft_ms_mean"] == pytest.approx(200.0) and s["ttft_ms_p50"] == pytest.approx(200.0)
    assert s["itl_ms_mean"] == pytest.approx(400 / 3)  # gaps 100, 200, 100 ms
    assert s["itl_ms_p50"] == pytest.approx(100.0)


def test_fixed_workload_ids_stay_in_the_vocabulary():
    args = compare._parse_args(["--base-url", "http://x", "--workload", "fixed", "--num-prompts", "70",
                                "--random-input-len", "16", "--random-output-len", "3"])
    reqs = compare.build_workload(args, 20, seed=1)
    assert len(reqs) == 70 and all(len(p) == 16 and o == 3 and all(4 <= t < 20 for t in p) for p, o in reqs)
    mixed = compare.build_workload(compare._parse_args(["--base-url", "http://x", "--num-prompts", "70"]), 512, 0)
    assert mixed[:64] == _workload_mixed(512, 0) and len(mixed) == 70
