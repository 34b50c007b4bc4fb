"""Weight updates broadcast by a trainer process over gloo (`trillium.rlhf.WeightSync`).

A trainer subprocess forms the update group with the server, pushes the
"next" checkpoint in several buckets (so the engine is paused around them)
and destroys the group: greedy outputs then equal `trillium.LLM` on "next"
and the version is the trainer's; a second trainer's init meanwhile is
refused (409) at once. A trainer that never joins makes the init
fail with an error reply after its timeout, and the server keeps serving
and can form a group afterwards. Without a group, a distributed update is 409.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from support import broadcast_trainer
from support.admin_server import MAX_TOKENS, PROMPTS, free_port

TRAINER = broadcast_trainer.__file__  # run as a script: the trainer is its own process


def test_cp_distributed_update_needs_a_group(server):
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}
    response = server.admin("POST", "/update_weights_from_distributed", json=body)
    assert response.status_code == 409, response.text


def test_cp_trainer_that_never_joins(server, references):
    started_s = time.monotonic()
    response = server.admin("POST", "/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2, "timeout_s": 2,
    })
    assert response.status_code == 504, response.text
    assert response.json()["error"]["type"] == "timeout_error"
    assert time.monotonic() - started_s < 60
    assert server.admin_ok("GET", "/health")["status"] == "ok"
    assert server.greedy(PROMPTS, MAX_TOKENS) == references["base"]
    assert server.admin_ok("GET", "/server_info")["engine_info"]["weights_update_group"] is None


@pytest.mark.heavy
def test_cp_trainer_pushes_by_broadcast(server, weights_root, references, restore_base):
    bucket_bytes = 256 << 10  # several buckets: the push pauses the engine around them
    run = subprocess.run(
        [sys.executable, TRAINER, server.admin_url, server.token, str(weights_root / "next"), "v-dist",
         str(bucket_bytes)],
        capture_output=True, text=True, timeout=180,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["weight_version"] == "v-dist"
    assert result["second_init_status"] == 409 and result["second_init_s"] < 30
    assert server.admin_ok("GET", "/weight_version") == {"weight_version": "v-dist"}
    assert server.admin_ok("GET", "/is_paused") == {"is_paused": False}
    assert server.greedy(PROMPTS, MAX_TOKENS) == references["next"]
    assert server.admin_ok("GET", "/server_info")["engine_info"]["weights_update_group"] is None
