"""A reward model under a real `trillium serve`: the pooling flags end to end, and
the control plane swapping its weights between RL steps.

`--runner pooling --convert reward --pooler-config '{"pooling_type": "LAST"}'`
serves a one-label Qwen3ForSequenceClassification as raw scores (vLLM's
flags: vllm/config/pooler.py; `reward` = the classifier's raw value);
/classify answers transformers' logit within 1e-4 before and after
POST /update_weights_from_disk loads another checkpoint (the same route the
generative server uses), and generation routes answer 400.
"""

from __future__ import annotations

import functools

import pytest
import torch

from support.admin_server import API_KEY, MODEL_NAME, AdminServer
from trillium.models.synthetic import build_checkpoint
from trillium.models.tokenizer import load_tokenizer

TEXTS = ["the quick brown fox", "a little robot paints the sea"]


@pytest.fixture(scope="module")
def reward_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward-weights")
    build_checkpoint(root / "base", "qwen3-reward", seed=0)
    build_checkpoint(root / "next", "qwen3-reward", seed=1)
    return root


@pytest.fixture(scope="module")
def reward_serve(reward_root):
    proc = AdminServer(
        str(reward_root / "base"), "--runner", "pooling", "--convert", "reward",
        "--pooler-config", '{"pooling_type": "LAST"}', "--allowed-weight-paths", str(reward_root),
        "--kv-cache-memory", "16MiB",
    ).wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


@functools.lru_cache(maxsize=2)
def _hf(path: str):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def _rewards(path) -> list[float]:
    tokenizer = load_tokenizer(path)
    return [float(_hf(str(path))(torch.tensor([tokenizer.encode(t)])).logits[0, 0]) for t in TEXTS]


def _classify(server) -> list[float]:
    response = server.http.post(server.base_url + "/classify", json={"model": MODEL_NAME, "input": TEXTS},
                                headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200, response.text
    return [d["probs"][0] for d in response.json()["data"]]


def test_reward_scores_follow_weight_updates(reward_serve, reward_root):
    assert _classify(reward_serve) == pytest.approx(_rewards(reward_root / "base"), abs=1e-4)
    reply = reward_serve.admin_ok("POST", "/update_weights_from_disk",
                                  json={"model_path": str(reward_root / "next")})
    assert reply["success"], reply
    after = _classify(reward_serve)
    assert after == pytest.approx(_rewards(reward_root / "next"), abs=1e-4)
    assert after != pytest.approx(_rewards(reward_root / "base"), abs=1e-3)
    refused = reward_serve.complete("hello", 4)
    assert refused.status_code == 400 and "pooling model" in refused.json()["error"]["message"]
