"""vLLM's and SGLang's quick-start command lines start `trillium serve` (real processes, loopback).

The lines are the peers' documented ones with the model swapped:

- vLLM (vllm-project/vllm docs/getting_started/quickstart.md and
  docs/serving/openai_compatible_server.md): `vllm serve Qwen/Qwen2.5-1.5B-Instruct`,
  `vllm serve NousResearch/Meta-Llama-3-8B-Instruct --dtype auto --api-key token-abc123`,
  and `--config config.yaml`; here the Hub id is a repository this test lays
  out in a private HF_HOME, served with HF_HUB_OFFLINE=1 (no network).
  Flags per vllm/entrypoints/openai/cli_args.py: several --served-model-name
  (all answer, /v1/models lists them), --response-role, --max-logprobs,
  --enable-log-requests, --allowed-origins (Starlette CORSMiddleware), and
  vllm/config/model.py `get_diff_sampling_param` for the generation config.
- SGLang (sgl-project/sglang docs/basic_usage/send_request.ipynb):
  `python3 -m sglang.launch_server --model-path qwen/qwen2.5-0.5b-instruct --host 0.0.0.0`,
  here with a local path, `--tp 1 --context-length 128`, and vLLM's
  --ssl-keyfile / --ssl-certfile (a self-signed certificate made with the
  openssl CLI; skipped without it).
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys

import httpx
import pytest

from support.hub_cache import populate_hub_cache
from support.serve_process import free_port, terminate
from support.waiting import wait_until

REPO = "test-org/tiny-qwen2"
API_KEY = "token-abc123"


class Server:
    """`python -m trillium.cli serve <argv>` on free ports, its log in a file."""

    def __init__(self, argv: list[str], tmp_path, *, env: dict | None = None, scheme: str = "http",
                 verify=True) -> None:
        import os

        self.port, admin_port = free_port(), free_port()
        self.base_url = f"{scheme}://127.0.0.1:{self.port}"
        self.verify = verify
        self.log_path = tmp_path / f"serve-{self.port}.log"
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "trillium.cli", "serve", *argv, "--port", str(self.port),
               "--admin-port", str(admin_port), "--executor-threads", "1"]
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self) -> "Server":
        def healthy() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"trillium serve exited {self.process.returncode}:\n{self.log()[-4000:]}")
            return httpx.get(self.base_url + "/health", timeout=2, verify=self.verify).status_code == 200

        wait_until(healthy, timeout_s=180, interval_s=0.2, what="trillium serve to be healthy",
                   ignoring=(httpx.HTTPError,), detail=lambda: self.log()[-4000:])
        return self

    def stop(self) -> int:
        return terminate(self.process, self._log)


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, checkpoint):
    home = tmp_path_factory.mktemp("hf-home")
    source = tmp_path_factory.mktemp("tiny-qwen2")
    for file in checkpoint("qwen2").iterdir():
        shutil.copy(file, source / file.name)
    generation = json.loads((source / "generation_config.json").read_text())
    (source / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.7, "top_k": 1}))
    populate_hub_cache(home / "hub", REPO, source)
    return home


@pytest.fixture(scope="module")
def vllm_server(hf_home, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-config")
    config = folder / "config.yaml"
    config.write_text("max_num_seqs: 8\nkv_cache_memory: 4MiB\nserved_model_name: [from-yaml]\n"
                      "override_generation_config: {max_new_tokens: 4}\nmax-model-len: 1k\n")
    argv = [REPO, "--dtype", "auto", "--api-key", API_KEY, "--config", str(config),
            "--served-model-name", "tiny", "alias", "--max-model-len", "0.2k", "--response-role", "helper",
            "--max-logprobs", "2", "--enable-log-requests", "--disable-log-stats", "--enable-sleep-mode",
            "--enable-chunked-prefill", "--trust-remote-code", "--seed", "0",
            "--allowed-origins", '["https://app.example"]']
    server = Server(argv, folder, env={"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}).wait_healthy()
    yield server
    assert server.stop() == 0, server.log()[-4000:]


def auth() -> dict:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_vllm_line_serves_the_cached_hub_model_under_every_name(vllm_server):
    cards = httpx.get(vllm_server.base_url + "/v1/models", headers=auth()).json()["data"]
    assert [c["id"] for c in cards] == ["tiny", "alias"]  # the command line's names beat the YAML's
    assert {c["max_model_len"] for c in cards} == {200}  # 0.2k, over the YAML's 1k
    assert httpx.get(vllm_server.base_url + "/v1/models").status_code == 401  # --api-key
    log = vllm_server.log()
    assert "models--test-org--tiny-qwen2/snapshots" in log
    assert "temperature=0.7" in log and "max_tokens=4" in log  # the defaults are reported at start


def test_generation_config_defaults_and_request_overrides(vllm_server):
    url = vllm_server.base_url + "/v1/completions"
    body = {"model": "alias", "prompt": "Once upon a time", "ignore_eos": True}
    defaulted = httpx.post(url, json=body, headers=auth()).json()
    assert defaulted["model"] == "alias"
    assert defaulted["usage"]["completion_tokens"] == 4  # --override-generation-config max_new_tokens
    greedy = httpx.post(url, json={**body, "temperature": 0, "max_tokens": 4}, headers=auth()).json()
    # top_k=1 from generation_config.json makes the default temperature 0.7 greedy.
    assert defaulted["choices"][0]["text"] == greedy["choices"][0]["text"]
    longer = httpx.post(url, json={**body, "max_tokens": 2}, headers=auth()).json()
    assert longer["usage"]["completion_tokens"] == 2  # the request's own (smaller) value wins
    assert "request cmpl-" in vllm_server.log()  # --enable-log-requests


def test_response_role_and_max_logprobs(vllm_server):
    url = vllm_server.base_url + "/v1/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = httpx.post(url, json=body, headers=auth()).json()
    assert reply["choices"][0]["message"]["role"] == "helper"
    refused = httpx.post(url, json={**body, "logprobs": True, "top_logprobs": 3}, headers=auth())
    assert refused.status_code == 400 and "--max-logprobs" in refused.json()["error"]["message"]


def test_cors_allowed_origins(vllm_server):
    preflight = httpx.options(vllm_server.base_url + "/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    simple = httpx.get(vllm_server.base_url + "/v1/models", headers={**auth(), "Origin": "https://app.example"})
    assert simple.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.get(vllm_server.base_url + "/v1/models", headers={**auth(), "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


@pytest.mark.heavy
def test_sglang_line_with_tls(checkpoint, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make a self-signed certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    context = ssl.create_default_context(cafile=str(cert))
    argv = ["--model-path", str(checkpoint("qwen2")), "--host", "127.0.0.1", "--tp", "1", "--context-length", "128",
            "--kv-cache-memory", "4MiB", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    server = Server(argv, tmp_path, scheme="https", verify=context).wait_healthy()
    try:
        reply = httpx.post(server.base_url + "/generate", verify=context, json={
            "text": "Once upon a time", "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                            "ignore_eos": True}}).json()
        assert reply["meta_info"]["completion_tokens"] == 3
        cards = httpx.get(server.base_url + "/v1/models", verify=context).json()["data"]
        assert cards[0]["max_model_len"] == 128 and cards[0]["id"] == checkpoint("qwen2").name
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)  # TLS only
    finally:
        assert server.stop() == 0, server.log()[-4000:]
