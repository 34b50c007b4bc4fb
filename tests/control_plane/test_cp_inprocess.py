"""Both planes wired by hand around an in-process engine, as `trillium serve` wires them.

Covers what a subprocess server cannot reach cheaply: a weight update whose
drain times out aborts the requests still running (they report the old
version only; the update then succeeds and new requests report the new
one), and a data plane built without the control plane's status probe
still refuses requests while the engine sleeps (it reads the engine's
SchedulerStats).
"""

from __future__ import annotations

import json

import httpx
import trio

from trillium.actors.client import EngineClient
from trillium.actors.assembly import ActorConfig, Addresses, engine_specs
from trillium.actors.supervisor import run_in_process
from trillium.config import EngineConfig
from trillium.control_plane import (
    ControlPlaneEngine,
    EngineStatus,
    create_admin_app,
    serve_admin_app,
)
from trillium.control_plane.paths import WeightPathPolicy
from trillium.data_plane import DataPlaneEngine, create_app, serve_app
from trillium.models.loader import load_model_config
from trillium.models.tokenizer import load_tokenizer

TOKEN = "inprocess-admin-token"


async def _stream_long(http: httpx.AsyncClient, first_chunk: trio.Event, out: dict) -> None:
    body = {"prompt": "Once", "max_tokens": 1800, "temperature": 0, "ignore_eos": True, "stream": True}
    chunks = out["chunks"] = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        out["header"] = response.headers["X-Weight-Version"]
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                first_chunk.set()


async def test_cp_drain_timeout_aborts_and_stats_fallback(checkpoint):
    path = str(checkpoint("llama", max_position_embeddings=2048))
    config = EngineConfig(model=path, num_threads=1, kv_cache_memory="16MiB").resolve()
    actor_config = ActorConfig(config, Addresses.inproc())
    client = EngineClient(actor_config)
    tokenizer = load_tokenizer(path)
    vocab_size = load_model_config(path).vocab_size
    status = EngineStatus(lambda: client.last_stats)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            await nursery.start(run_in_process, engine_specs(actor_config))

            def data_app(**extra):
                return create_app(DataPlaneEngine(client=client, tokenizer=tokenizer, served_model_name="m",
                                                  max_model_len=config.max_model_len, vocab_size=vocab_size,
                                                  **extra))

            admin = ControlPlaneEngine(client=client, engine_config=config, admin_token=TOKEN,
                                       weight_paths=WeightPathPolicy((path,)), status=status, drain_timeout_s=0.3)
            admin_port = await nursery.start(serve_admin_app, create_admin_app(admin), "127.0.0.1", 0)
            wired_port = await nursery.start(serve_app, data_app(engine_status=status.snapshot), "127.0.0.1", 0)
            plain_port = await nursery.start(serve_app, data_app(), "127.0.0.1", 0)
            auth = {"Authorization": f"Bearer {TOKEN}"}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin_port}", headers=auth, timeout=120) as adm, \
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{wired_port}", timeout=120) as wired, \
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{plain_port}", timeout=120) as plain:
                # 1. An update whose drain times out aborts the long stream, which keeps one version.
                first_chunk, out = trio.Event(), {}
                async with trio.open_nursery() as streams:
                    streams.start_soon(_stream_long, wired, first_chunk, out)
                    await first_chunk.wait()
                    reply = await adm.post("/update_weights_from_disk", json={"model_path": path,
                                                                              "weight_version": "v2"})
                assert reply.status_code == 200, reply.text
                assert reply.json()["weight_version"] == "v2"
                finals = [c["choices"][0]["finish_reason"] for c in out["chunks"] if c["choices"]]
                assert finals[-1] == "abort"
                assert {c["weight_version"] for c in out["chunks"]} == {out["header"]} == {"0"}
                after = await wired.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2})
                assert after.json()["weight_version"] == "v2" == after.headers["X-Weight-Version"]

                # 2. Without the status probe the data plane follows the engine's stats.
                assert (await adm.post("/sleep", json={"level": 1})).status_code == 200
                for app in (wired, plain):
                    refused = await app.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2})
                    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
                    assert refused.json()["error"]["code"] == "engine_sleeping"
                models = (await plain.get("/v1/models")).json()["data"]
                assert models[0]["weight_version"] == "v2"
                assert (await adm.post("/wake_up")).status_code == 200
                for app in (wired, plain):
                    ok = await app.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2})
                    assert ok.status_code == 200 and ok.json()["weight_version"] == "v2"
            nursery.cancel_scope.cancel()
    finally:
        client.close()
