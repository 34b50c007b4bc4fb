"""Admin authentication against a real `trillium serve`.

Every admin route answers 401 without a token, with a wrong one, and with
the data-plane API key; the admin token never opens the data plane; an
unauthenticated large upload is refused without being read; a non-loopback
admin host without a token (or an admin token equal to the API key)
refuses to start with exit code 2.
"""

from __future__ import annotations

import os
import subprocess

import httpx
import pytest

from support.admin_server import ADMIN_TOKEN, API_KEY, MODEL_NAME, free_port, serve_command

ROUTES = [
    ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
    ("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"),
    ("POST", "/update_weights_from_disk"), ("POST", "/update_weights_from_tensor"), ("GET", "/weight_version"),
    ("POST", "/init_weights_update_group"), ("POST", "/update_weights_from_distributed"),
    ("POST", "/destroy_weights_update_group"),
    ("POST", "/start_profile"), ("POST", "/stop_profile"),
    ("POST", "/reset_prefix_cache"), ("POST", "/abort_requests"),
    ("GET", "/server_info"), ("GET", "/health"), ("GET", "/metrics"),
    ("GET", "/tracing"), ("POST", "/tracing"),
    ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
    # SGLang's names (sglang/srt/entrypoints/http_server.py, v1_loads.py)
    ("POST", "/pause_generation"), ("POST", "/continue_generation"),
    ("POST", "/release_memory_occupation"), ("POST", "/resume_memory_occupation"),
    ("GET", "/flush_cache"), ("POST", "/flush_cache"), ("POST", "/abort_request"),
    ("GET", "/get_weight_version"), ("POST", "/update_weight_version"), ("GET", "/health_generate"),
    ("GET", "/get_server_info"), ("GET", "/get_model_info"), ("GET", "/get_load"), ("GET", "/v1/loads"),
    ("POST", "/load_lora_adapter"), ("POST", "/unload_lora_adapter"),
    ("POST", "/sleep?level=2"),  # a query does not get around the token either
    ("GET", "/no_such_route"),  # unknown routes do not reveal themselves either
]


@pytest.mark.parametrize("case", ["missing", "wrong", "data_plane_key", "not_bearer"])
def test_cp_every_route_needs_the_admin_token(server, case):
    headers = {
        "missing": {},
        "wrong": {"Authorization": "Bearer not-the-token"},
        "data_plane_key": {"Authorization": f"Bearer {API_KEY}"},
        "not_bearer": {"Authorization": ADMIN_TOKEN},
    }[case]
    for method, path in ROUTES:
        response = server.http.request(method, server.admin_url + path, headers=headers, json={})
        assert response.status_code == 401, (method, path, response.status_code, response.text)
        assert response.json()["error"]["code"] == "invalid_admin_token"
        assert response.headers["WWW-Authenticate"] == "Bearer"
    # Nothing happened: the engine still serves.
    assert server.admin_ok("GET", "/is_sleeping") == {"is_sleeping": False}


def test_cp_admin_token_opens_only_the_admin(server):
    assert server.admin_ok("GET", "/health")["status"] == "ok"
    assert server.complete("Hi", 2, key=ADMIN_TOKEN).status_code == 401
    models = server.http.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert models.status_code == 401
    assert server.complete("Hi", 2).status_code == 200


def test_cp_unauthenticated_upload_is_refused_unread(server):
    body = b"\0" * (8 << 20)
    with httpx.Client(timeout=30) as client:
        response = client.post(server.admin_url + "/update_weights_from_tensor", content=body,
                               headers={"Content-Type": "application/octet-stream"})
        assert response.status_code == 401
    assert server.admin_ok("GET", "/weight_version")["weight_version"]  # the server is fine


def _refused_start(model: str, *extra: str, env: dict) -> subprocess.CompletedProcess:
    cmd = serve_command(model, "--port", str(free_port()), "--admin-port", str(free_port()),
                        "--served-model-name", MODEL_NAME, *extra)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_cp_unsafe_admin_settings_refuse_to_start(weights_root):
    env = {k: v for k, v in os.environ.items() if k not in ("TRILLIUM_ADMIN_TOKEN", "TRILLIUM_API_KEY")}
    model = str(weights_root / "base")
    open_host = _refused_start(model, "--admin-host", "0.0.0.0", env=env)
    assert open_host.returncode == 2, open_host.stderr
    assert "non-loopback" in open_host.stderr and "--admin-token" in open_host.stderr
    same_key = _refused_start(model, "--api-key", "k-same", "--admin-token", "k-same", env=env)
    assert same_key.returncode == 2, same_key.stderr
    assert "must differ" in same_key.stderr
