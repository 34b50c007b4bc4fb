"""Weight updates from disk and over HTTP on a real server, with and without load.

A disk update to another checkpoint makes greedy outputs equal
`trillium.LLM` on that checkpoint and moves weight_version everywhere it is
reported (/weight_version, /server_info, /metrics, /v1/models, response
bodies, stream chunks and the X-Weight-Version header). Paths outside the
allowed roots (also through a symlink or `..`) are 403. A safetensors
upload with a bad shape or name is 400 and the old weights keep serving.
Under 16 concurrent streams, every response reports exactly one version,
its text matches that version's checkpoint, and requests started after the
update returned run on the new weights.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import save

from support.admin_server import API_KEY, MAX_TOKENS, MODEL_NAME, PROMPTS
from support.update_load import UpdateLoad


def _version_everywhere(server) -> set[str]:
    """The weight version as each surface reports it (one element when they agree)."""
    seen = {server.admin_ok("GET", "/weight_version")["weight_version"],
            server.admin_ok("GET", "/server_info")["weight_version"]}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    seen |= {card["weight_version"] for card in server.http.get(server.base_url + "/v1/models", headers=auth)
             .json()["data"]}
    seen.add(server.http.get(server.base_url + f"/v1/models/{MODEL_NAME}", headers=auth).json()["weight_version"])
    response = server.complete(PROMPTS[0], 2)
    seen |= {response.json()["weight_version"], response.headers["X-Weight-Version"]}
    chat = server.http.post(server.base_url + "/v1/chat/completions", headers=auth, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True})
    seen.add(chat.headers["X-Weight-Version"])
    seen |= {json.loads(line[6:])["weight_version"] for line in chat.text.splitlines()
             if line.startswith("data: {")}
    metrics = server.admin("GET", "/metrics").text
    seen |= {line.split('weight_version="')[1].split('"')[0] for line in metrics.splitlines()
             if line.startswith("trillium:weight_version_info{")}
    return seen


def test_cp_disk_paths_outside_the_roots_are_403(server, weights_root, references):
    for path in (weights_root.parent / "elsewhere", weights_root / "escape", weights_root / "next" / ".." / "..",
                 "/etc"):
        response = server.admin("POST", "/update_weights_from_disk", json={"model_path": str(path)})
        assert response.status_code == 403, (path, response.text)
        assert response.json()["error"]["param"] == "model_path"
    missing = server.admin("POST", "/update_weights_from_disk", json={"model_path": str(weights_root / "nope")})
    assert missing.status_code == 400
    assert server.greedy(PROMPTS, MAX_TOKENS) == references["base"]


def test_cp_disk_update_changes_outputs_and_version(server, weights_root, references, restore_base):
    assert len(_version_everywhere(server)) == 1
    reply = server.admin_ok("POST", "/update_weights_from_disk",
                            json={"model_path": str(weights_root / "next"), "weight_version": "v-next"})
    assert reply["weight_version"] == "v-next"
    assert _version_everywhere(server) == {"v-next"}
    assert server.greedy(PROMPTS, MAX_TOKENS) == references["next"]
    # Without a version the engine bumps the one it serves.
    bumped = server.admin_ok("POST", "/update_weights_from_disk", json={"model_path": str(weights_root / "base")})
    assert bumped["weight_version"] not in ("v-next", "")
    assert _version_everywhere(server) == {bumped["weight_version"]}
    assert server.greedy(PROMPTS, MAX_TOKENS) == references["base"]


def _upload(server, data: bytes, **params):
    return server.admin("POST", "/update_weights_from_tensor", content=data, params=params,
                        headers={"Content-Type": "application/octet-stream"})


def test_cp_tensor_update_validates_then_swaps(server, weights_root, references, restore_base):
    version = server.admin_ok("GET", "/weight_version")["weight_version"]
    bad_shape = save({"model.embed_tokens.weight": torch.zeros(3, 5)})
    unknown = save({"model.layers.99.mlp.up_proj.weight": torch.zeros(2, 2)})
    for data in (bad_shape, unknown, b"definitely not safetensors", b""):
        response = _upload(server, data, weight_version="never")
        assert response.status_code == 400, response.text
    assert server.admin_ok("GET", "/weight_version")["weight_version"] == version
    assert server.greedy(PROMPTS, MAX_TOKENS) == references["base"]
    full = (weights_root / "next" / "model.safetensors").read_bytes()
    response = _upload(server, full, weight_version="v-tensor", flush_cache="true")
    assert response.status_code == 200, response.text
    assert response.json()["weight_version"] == "v-tensor"
    assert server.greedy(PROMPTS, MAX_TOKENS) == references["next"]


@pytest.mark.heavy
def test_cp_update_under_load(server, weights_root, references, restore_base):
    old = server.admin_ok("GET", "/weight_version")["weight_version"]
    load = UpdateLoad(server)
    for thread in load.threads:
        thread.start()
    try:
        load.wait_for(16)
        server.admin_ok("POST", "/update_weights_from_disk",
                        json={"model_path": str(weights_root / "next"), "weight_version": "v-load"})
        returned_s = time.monotonic()
        load.wait_for(32, since_s=returned_s)
    finally:
        load.stop.set()
        for thread in load.threads:
            thread.join(60)
    expected = {old: references["base"], "v-load": references["next"]}
    for record in load.records:
        assert record["versions"] == {record["header"]}, record  # exactly one version per response
        assert record["text"] == expected[record["header"]][record["prompt_index"]], record
        if record["started_s"] > returned_s:
            assert record["header"] == "v-load", record
    assert {r["header"] for r in load.records} == {old, "v-load"}
