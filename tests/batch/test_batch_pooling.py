"""run-batch on a pooling model: /v1/embeddings lines work (the batch's app carries the model's
pooling task, as `trillium serve`'s does), generation lines are that route's 400.

In process (batch/runner.py `run_batch`, the engine over inproc://); the CLI end to end is
tests/data_plane/test_dp_run_batch.py. Embeddings equal `LLM.embed` on the same checkpoint.
"""

from __future__ import annotations

import json

import pytest

from trillium import LLM
from trillium.batch.runner import BatchOptions, prepare_files, run_batch
from trillium.config import EngineConfig


def test_embeddings_lines_on_a_pooling_model(checkpoint, tmp_path):
    path = str(checkpoint("qwen3-embed"))
    lines = [
        {"custom_id": "e1", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "hello world"}},
        {"custom_id": "c1", "method": "POST", "url": "/v1/completions",
         "body": {"model": "m", "prompt": "hi", "max_tokens": 2}},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    options = BatchOptions(str(source), str(tmp_path / "out.jsonl"), max_concurrency=2, progress=False)
    config = EngineConfig(model=path, served_model_name="m", runner="pooling", num_threads=1).resolve()
    summary = run_batch(config, options, prepare_files(options), {})
    assert (summary.num_succeeded, summary.num_failed) == (1, 1)
    results = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert results["c1"]["response"]["status_code"] == 400
    assert "pooling model" in results["c1"]["error"]["message"]
    embedding = results["e1"]["response"]["body"]["data"][0]["embedding"]
    with LLM(path, runner="pooling") as llm:
        expected = llm.embed(["hello world"])[0].outputs.embedding
    assert embedding == pytest.approx(list(expected), abs=1e-5)
