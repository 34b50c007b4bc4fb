"""create_app / serve_app wired by hand inside a trio test, as `trillium serve` does.

The engine actors run in this test's nursery (run_in_process + EngineClient,
`trillium.LLM._engine_main`'s wiring); two apps on port 0 share it. Covers:
the reported port is the bound one, served-name aliases, /health follows
the probe (and an unhealthy engine refuses generation with 503), the
engine's refusal of an oversized request is a 400, and a graceful shutdown lets an in-flight stream finish, then
serve_app returns.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import trio

from trillium.actors.client import EngineClient
from trillium.actors.assembly import ActorConfig, Addresses, engine_specs
from trillium.actors.supervisor import run_in_process
from trillium.config import EngineConfig
from trillium.data_plane import DataPlaneEngine, create_app, serve_app
from trillium.models.loader import load_model_config
from trillium.models.tokenizer import load_tokenizer


async def test_serve_two_apps_health_and_graceful_shutdown(checkpoint):
    path = str(checkpoint("llama"))
    # 8 blocks of 16 tokens: a request that may grow past 128 tokens is refused by the scheduler
    config = EngineConfig(model=path, num_threads=1, num_blocks=8).resolve()
    actor_config = ActorConfig(config, Addresses.inproc())
    client = EngineClient(actor_config)
    tokenizer = load_tokenizer(path)
    vocab_size = load_model_config(path).vocab_size
    healthy = {"ok": True}
    shutdown = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            await nursery.start(run_in_process, engine_specs(actor_config))

            def bundle(names, **extra) -> DataPlaneEngine:
                return DataPlaneEngine(client=client, tokenizer=tokenizer, served_model_name=names,
                                       max_model_len=config.max_model_len, vocab_size=vocab_size, **extra)

            main_app = create_app(bundle(["main", "main-alias"], health=lambda: (healthy["ok"], "probe")))
            other_app = create_app(bundle("other"))
            main_port = await nursery.start(serve_app, main_app, "127.0.0.1", 0)
            other_port = await nursery.start(serve_app, other_app, "127.0.0.1", 0)
            stopped = trio.Event()

            async def graceful_server(*, task_status) -> None:
                await serve_app(create_app(bundle("main")), "127.0.0.1", 0,
                                shutdown_trigger=shutdown.wait, task_status=task_status)
                stopped.set()

            graceful_port = await nursery.start(graceful_server)
            assert 0 not in (main_port, other_port, graceful_port)

            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{main_port}") as http:
                models = (await http.get("/v1/models")).json()["data"]
                assert [m["id"] for m in models] == ["main", "main-alias"]
                alias = await http.post("/v1/completions", json={"model": "main-alias", "prompt": "a", "max_tokens": 2})
                assert alias.status_code == 200 and alias.json()["model"] == "main-alias"
                assert (await http.get("/health")).status_code == 200
                healthy["ok"] = False
                sick = await http.get("/health")
                assert sick.status_code == 503 and sick.json()["detail"] == "probe"
                refused = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
                assert refused.status_code == 503 and "Retry-After" in refused.headers
                assert refused.json()["error"]["code"] == "engine_unavailable"

            sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{other_port}/v1", api_key="x", max_retries=0)
            async with sdk:
                done = await sdk.completions.create(model="other", prompt="a", max_tokens=2)
                assert done.usage.completion_tokens == 2
                # the engine's refusal (too big for the KV cache) is a 400, streamed or not
                with pytest.raises(openai.BadRequestError, match="KV blocks"):
                    await sdk.completions.create(model="other", prompt="a", max_tokens=200)
                with pytest.raises(openai.APIError, match="KV blocks"):
                    stream = await sdk.chat.completions.create(
                        model="other", messages=[{"role": "user", "content": "a"}], max_tokens=200, stream=True)
                    async for _ in stream:
                        pass

            # graceful: the stream that is running when the trigger fires still completes
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{graceful_port}", timeout=60) as http:
                body = {"prompt": [5, 6], "max_tokens": 40, "ignore_eos": True, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    lines = [line async for line in _first_then_rest(response, shutdown)]
                assert lines[-1] == "data: [DONE]"
                assert sum(line.startswith("data: {") for line in lines) == 40
            with trio.fail_after(30):
                await stopped.wait()  # serve_app returned once the stream was done
            nursery.cancel_scope.cancel()
    finally:
        client.close()


async def _first_then_rest(response: httpx.Response, shutdown: trio.Event):
    async for line in response.aiter_lines():
        if line:
            shutdown.set()  # trigger the graceful stop once the stream is under way
            yield line
