"""Multi-LoRA over HTTP: a real `trillium serve --enable-lora`, the OpenAI SDK, the admin routes.

Adapters come from support.lora_adapters.make_peft_adapter (random non-zero PEFT
weights on the synthetic checkpoint); expected tokens from transformers +
peft (support.lora_adapters.peft_greedy).
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from support.lora_adapters import ADAPTERS, copy_adapter, make_peft_adapter, peft_greedy
from support.serve_process import ServeProcess
from support.waiting import wait_until


pytest.importorskip("peft")
openai = pytest.importorskip("openai")

TOKEN = "lora-admin-token"
MAX_TOKENS = 8
PROMPTS = [[5, 17, 99, 250, 31], [400, 3, 77, 12, 8, 190, 44], [9, 9, 120, 301]]


@pytest.fixture(scope="module")
def setup(checkpoint, tmp_path_factory):
    base = checkpoint("llama")
    root = tmp_path_factory.mktemp("http-adapters")
    adapters = {name: make_peft_adapter(base, root / name, 20 + seed, **kw)
                for seed, (name, kw) in enumerate(ADAPTERS.items())}
    copy_adapter(adapters["attn"], root / "bad-targets", target_modules=["made_up_proj"])
    server = ServeProcess(str(base), "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                          "--lora-modules", f"attn={adapters['attn']}", "--allowed-lora-paths", str(root),
                          "--kv-cache-memory", "4MiB", env={"TRILLIUM_ADMIN_TOKEN": TOKEN}).wait_healthy()
    yield base, root, adapters, server
    server.stop()


def admin(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.admin_url + path, json=body, headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=120)


def complete(server, model: str, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    out = []
    for prompt in prompts:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          logprobs=0, extra_body={"min_tokens": max_tokens})
        out.append(reply.choices[0].logprobs.tokens)
    return out


def _tokens(base, ids_lists) -> list[list[str]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    return [[tok.decode([i]) for i in ids] for ids in ids_lists]


def test_startup_adapter_is_listed_and_matches_peft(setup):
    base, _, adapters, server = setup
    models = {m["id"]: m for m in httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"]}
    assert models["attn"]["parent"] == "test-model" and models["test-model"]["parent"] is None
    got = complete(server, "attn", PROMPTS)
    assert got == _tokens(base, peft_greedy(base, adapters["attn"], PROMPTS, MAX_TOKENS))
    assert got != _tokens(base, peft_greedy(base, None, PROMPTS, MAX_TOKENS))
    assert complete(server, "test-model", PROMPTS) == _tokens(base, peft_greedy(base, None, PROMPTS, MAX_TOKENS))


def test_load_under_streaming_load_then_mixed_requests_match_peft(setup):
    base, _, adapters, server = setup
    expected_base = _tokens(base, peft_greedy(base, None, PROMPTS, MAX_TOKENS))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(complete, server, "test-model", PROMPTS) for _ in range(3)]
        assert admin(server, "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": str(adapters["mlp"])}
                     ).status_code == 200
        assert all(s.result() == expected_base for s in streams), "a load between steps disturbs nobody"
    # Three models at once with two slots: the scheduler holds one adapter's requests back.
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        jobs = {name: pool.submit(complete, server, name, PROMPTS) for name in ("attn", "mlp", "test-model")}
        results = {name: job.result() for name, job in jobs.items()}
    assert results["mlp"] == _tokens(base, peft_greedy(base, adapters["mlp"], PROMPTS, MAX_TOKENS))
    assert results["attn"] == _tokens(base, peft_greedy(base, adapters["attn"], PROMPTS, MAX_TOKENS))
    assert results["test-model"] == expected_base
    metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("trillium:lora")}
    assert samples['trillium:lora_loads_total{model_name="test-model"}'] >= 2
    assert samples['trillium:lora_swap_ins_total{model_name="test-model"}'] >= 2
    assert any('max_lora="2"' in key for key in samples if key.startswith("trillium:lora_requests_info"))


def test_load_errors(setup):
    base, root, adapters, server = setup
    cases = [
        ({"lora_name": "attn", "lora_path": str(adapters["attn"])}, 409),  # name taken
        ({"lora_name": "big", "lora_path": str(adapters["all"])}, 400),  # rank 16 > --max-lora-rank 8
        ({"lora_name": "bad", "lora_path": str(root / "bad-targets")}, 400),  # module the model lacks
        ({"lora_name": "gone", "lora_path": str(root / "missing")}, 400),
        ({"lora_name": "out", "lora_path": str(base)}, 403),  # outside --allowed-lora-paths
        ({"lora_name": ""}, 400),
    ]
    for body, status in cases:
        response = admin(server, "/v1/load_lora_adapter", body)
        assert response.status_code == status, (body, response.text)
        assert "error" in response.json()
    unauthorized = httpx.post(server.admin_url + "/v1/load_lora_adapter", json=cases[0][0], timeout=10)
    assert unauthorized.status_code == 401
    assert admin(server, "/v1/unload_lora_adapter", {"lora_name": "never"}).status_code == 404
    missing = httpx.post(server.base_url + "/v1/completions", json={"model": "big", "prompt": "a"}, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_generate_lora_path_matches_peft(setup):
    """SGLang's /generate with `lora_path` (GenerateReqInput.lora_path in sgl-project/sglang
    python/sglang/srt/managers/io_struct.py: one name, or one per prompt) picks the adapter the
    way `model` does on /v1/completions."""
    base, _, adapters, server = setup
    params = {"temperature": 0, "max_new_tokens": MAX_TOKENS, "min_new_tokens": MAX_TOKENS}

    def generate(body: dict) -> httpx.Response:
        return httpx.post(server.base_url + "/generate", json={"input_ids": PROMPTS, "sampling_params": params,
                                                                **body}, timeout=120)

    tuned = peft_greedy(base, adapters["attn"], PROMPTS, MAX_TOKENS)
    plain = peft_greedy(base, None, PROMPTS, MAX_TOKENS)
    assert [o["output_ids"] for o in generate({"lora_path": "attn"}).json()] == tuned
    mixed = generate({"lora_path": ["attn", None, "test-model"]}).json()
    assert [o["output_ids"] for o in mixed] == [tuned[0], plain[1], plain[2]]
    missing = generate({"lora_path": "not-loaded"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"


def wait_running(server, timeout_s: float = 60) -> None:
    running = 'trillium:num_requests_running{model_name="test-model"} 1'
    wait_until(lambda: running in httpx.get(server.base_url + "/metrics", timeout=10).text,
               timeout_s=timeout_s, interval_s=0.01, what="the stream to start (one request running)")


def test_unload_waits_for_or_aborts_the_requests_using_it(setup):
    base, _, adapters, server = setup
    assert admin(server, "/v1/load_lora_adapter", {"lora_name": "long", "lora_path": str(adapters["mlp"])}
                 ).status_code == 200
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")

    def stream(max_tokens: int):
        chunks = client.completions.create(model="long", prompt=[5, 6, 7], max_tokens=max_tokens, stream=True,
                                           temperature=0, extra_body={"ignore_eos": True})
        texts, reason = 0, None
        for chunk in chunks:
            for choice in chunk.choices:
                texts += 1 if choice.text else 0
                reason = choice.finish_reason or reason
        return texts, reason

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(stream, 60)
        wait_running(server)
        assert admin(server, "/v1/unload_lora_adapter", {"lora_name": "long", "mode": "wait"}).status_code == 200
        assert running.result()[1] == "length", "wait mode lets it finish"
    assert httpx.post(server.base_url + "/v1/completions", json={"model": "long", "prompt": "a"},
                      timeout=10).status_code == 404

    assert admin(server, "/v1/load_lora_adapter", {"lora_name": "long", "lora_path": str(adapters["mlp"])}
                 ).status_code == 200
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(stream, 200)
        wait_running(server)
        assert admin(server, "/v1/unload_lora_adapter", {"lora_name": "long", "mode": "abort"}).status_code == 200
        assert running.result()[1] == "abort"
