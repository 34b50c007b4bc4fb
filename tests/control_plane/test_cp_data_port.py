"""`--admin-on-data-port` and LoRA loading the way vLLM and SGLang clients do it, on real servers.

slime and verl send admin calls to the generation base URL with no auth
header (THUDM/slime slime/backends/sglang_utils/sglang_engine.py posts
/pause_generation, /flush_cache, /update_weights_from_distributed to the
server URL; volcengine/verl verl/workers/rollout/sglang_rollout/http_server_engine.py
does the same for /release_memory_occupation, /resume_memory_occupation).
Without an admin token the flag is allowed on a loopback --host only and
the routes there are open; with a token every admin route there needs it;
a non-loopback --host without a token exits with code 2.

LoRA: vLLM's POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}
(vllm-project/vllm vllm/entrypoints/serve/lora/protocol.py, LoadLoRAAdapterRequest)
on the data port, where vLLM clients call it, and SGLang's /load_lora_adapter,
/unload_lora_adapter {lora_name, lora_path} answered as LoRAUpdateOutput
(sgl-project/sglang python/sglang/srt/managers/io_struct.py). load_inplace
replaces a loaded adapter: new requests get the new one, a stream in flight
finishes on the old one.
"""

from __future__ import annotations

import os
import subprocess
import threading

import httpx
import pytest

from support.admin_server import ADMIN_TOKEN, API_KEY, AdminServer, free_port, serve_command
from support.serve_process import ServeProcess
from support.waiting import wait_until
from trillium.control_plane.auth import AdminConfigError, data_port_requires_token

PROMPT = "Once upon a time"


def test_cp_data_port_policy():
    assert data_port_requires_token("0.0.0.0", token_given=True) is True
    assert data_port_requires_token("127.0.0.1", token_given=True) is True
    assert data_port_requires_token("localhost", token_given=False) is False
    with pytest.raises(AdminConfigError, match="non-loopback"):
        data_port_requires_token("0.0.0.0", token_given=False)


def test_cp_data_port_needs_a_token_off_loopback(checkpoint):
    env = {k: v for k, v in os.environ.items() if k != "TRILLIUM_ADMIN_TOKEN"}
    cmd = serve_command(str(checkpoint("llama")), "--host", "0.0.0.0", "--port", str(free_port()),
                        "--admin-port", str(free_port()), "--admin-on-data-port")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 2, run.stderr
    assert "--admin-on-data-port" in run.stderr and "--admin-token" in run.stderr


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory):
    return tmp_path_factory.mktemp("dp-adapters")


@pytest.fixture(scope="module")
def adapters(checkpoint, lora_root):
    pytest.importorskip("peft")
    from support.lora_adapters import ADAPTERS, make_peft_adapter

    base = checkpoint("llama")
    return {name: make_peft_adapter(base, lora_root / name, 40 + i, **ADAPTERS[name])
            for i, name in enumerate(("attn", "mlp"))}


@pytest.fixture(scope="module")
def open_server(checkpoint, lora_root):
    base, root = checkpoint("llama"), lora_root
    server = ServeProcess(str(base), "--admin-on-data-port", "--enable-lora", "--max-loras", "2",
                          "--max-lora-rank", "8", "--allowed-lora-paths", str(root), "--kv-cache-memory", "8MiB",
                          env={"TRILLIUM_ADMIN_TOKEN": ""}).wait_healthy()
    yield server
    assert server.stop() == 0, server.log()


def _complete(server, model: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def test_cp_open_data_port_serves_admin_routes(open_server):
    base = open_server.base_url
    assert httpx.post(base + "/sleep?level=1", timeout=60).status_code == 200  # no auth header, as slime
    assert httpx.get(base + "/is_sleeping", timeout=10).json() == {"is_sleeping": True}
    assert _complete(open_server, "test-model").status_code == 503
    assert httpx.post(base + "/wake_up", timeout=60).status_code == 200
    assert _complete(open_server, "test-model").status_code == 200
    assert httpx.get(base + "/health", timeout=10).json() == {"status": "ok"}  # the data plane's own /health
    # The admin port itself still needs its (generated) token.
    assert httpx.post(open_server.admin_url + "/sleep", timeout=10).status_code == 401
    assert "--admin-on-data-port without an admin token" in open_server.log()


@pytest.mark.heavy
def test_cp_lora_like_the_clients_load_it(open_server, adapters):
    paths = adapters
    base = open_server.base_url
    loaded = httpx.post(base + "/load_lora_adapter", timeout=120,
                        json={"lora_name": "a", "lora_path": str(paths["attn"])})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json() == {"success": True, "error_message": None, "loaded_adapters": {"a": str(paths["attn"])}}
    assert httpx.post(base + "/load_lora_adapter", timeout=60,
                      json={"lora_name": "a", "lora_path": str(paths["mlp"])}).status_code == 409
    assert httpx.post(base + "/load_lora_adapter", timeout=60, json={
        "lora_name": "p", "lora_path": str(paths["mlp"]), "pinned": True}).json()["error"]["param"] == "pinned"
    assert httpx.post(base + "/v1/load_lora_adapter", timeout=120,
                      json={"lora_name": "b", "lora_path": str(paths["mlp"])}).status_code == 200
    text_a, text_b = (_complete(open_server, name, 120).json()["choices"][0]["text"] for name in ("a", "b"))
    assert text_a != text_b

    # A request on "a" in flight while "a" is replaced in place keeps the old adapter to its end.
    result = {}

    def generate() -> None:
        result["response"] = _complete(open_server, "a", 120)

    thread = threading.Thread(target=generate)
    thread.start()
    wait_until(lambda: httpx.get(base + "/get_load", timeout=10).json()[0]["num_reqs"] >= 1, timeout_s=60,
               interval_s=0.01, what="the request on 'a' to reach the engine")
    replaced = httpx.post(base + "/v1/load_lora_adapter", timeout=120,
                          json={"lora_name": "a", "lora_path": str(paths["mlp"]), "load_inplace": True})
    assert replaced.status_code == 200, replaced.text
    thread.join(120)
    assert result["response"].json()["choices"][0]["text"] == text_a
    assert _complete(open_server, "a", 120).json()["choices"][0]["text"] == text_b  # new requests: the new one
    models = {m["id"] for m in httpx.get(base + "/v1/models", timeout=10).json()["data"]}
    assert {"a", "b"} <= models

    unloaded = httpx.post(base + "/unload_lora_adapter", timeout=120, json={"lora_name": "b"})
    assert unloaded.status_code == 200 and unloaded.json()["loaded_adapters"] == {"a": str(paths["mlp"])}
    assert _complete(open_server, "b").status_code == 404


@pytest.fixture(scope="module")
def token_server(checkpoint):
    server = AdminServer(str(checkpoint("llama")), "--admin-on-data-port", "--kv-cache-memory", "8MiB").wait_ready()
    yield server
    assert server.stop() == 0, server.log()


def test_cp_data_port_admin_routes_need_the_token(token_server):
    base = token_server.base_url
    for headers in ({}, {"Authorization": f"Bearer {API_KEY}"}, {"Authorization": "Bearer wrong"}):
        refused = httpx.post(base + "/sleep?level=1", headers=headers, timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_admin_token"
        assert httpx.post(base + "/pause_generation", headers=headers, json={}, timeout=10).status_code == 401
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    assert httpx.post(base + "/sleep?level=1", headers=admin, timeout=60).status_code == 200
    assert httpx.get(base + "/is_sleeping", headers=admin, timeout=10).json() == {"is_sleeping": True}
    assert httpx.post(base + "/wake_up", headers=admin, timeout=60).status_code == 200
    # The data plane is unchanged: its key opens it, the admin token does not.
    assert token_server.complete(PROMPT, 2).status_code == 200
    assert token_server.complete(PROMPT, 2, key=ADMIN_TOKEN).status_code == 401
