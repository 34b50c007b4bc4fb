"""Updating the speculative draft through the control plane, over real HTTP on loopback.

Both planes around one in-process engine (as tests/control_plane/test_cp_inprocess.py
wires them) serving a draft model: the target's architecture with perturbed
weights. Routing as SGLang's (sgl-project/sglang
python/sglang/srt/managers/scheduler_update_weights_mixin.py hands tensor
updates to the draft worker; io_struct.py UpdateWeightsFromTensorReqInput
`disable_draft_model`), with `draft_model_only` (the flag SGLang-based RL
rollouts send to update the draft alone) naming the draft: a draft update
from disk moves `draft_weight_version` and not the target's `weight_version`;
updating the draft to the target's own weights makes every greedy draft
accepted (acceptance 1.0); greedy output is the non-speculative one
throughout (the per-request opt-out in the same engine); a bad draft update is
a 4xx and the old draft keeps serving; `WeightSync.push_tensors(...,
draft_model_only=True)` updates it from tensors; routings Trillium does not
implement are 400s naming the field; a target update reports what happened to
the draft.
"""

from __future__ import annotations

import httpx
import torch
import trio
from safetensors.torch import load_file, save

from trillium.actors.assembly import ActorConfig, Addresses, engine_specs
from trillium.actors.client import EngineClient
from trillium.actors.supervisor import run_in_process
from trillium.config import EngineConfig
from trillium.control_plane import ControlPlaneEngine, EngineStatus, create_admin_app, serve_admin_app
from trillium.control_plane.paths import WeightPathPolicy
from trillium.data_plane import DataPlaneEngine, create_app, serve_app
from trillium.models.loader import load_model_config
from trillium.models.tokenizer import load_tokenizer
from trillium.rlhf import WeightSync

TOKEN = "draft-update-token"
PROMPTS = ("Once upon a time",)


async def _greedy(http: httpx.AsyncClient, speculative: bool) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "speculative": speculative}
        reply = await http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        texts.append(reply.json()["choices"][0]["text"])
    return texts


async def _acceptance(adm: httpx.AsyncClient, client: EngineClient, since: tuple[int, int]) -> tuple[float, tuple]:
    """Accepted / draft tokens since `since`. WHY /server_info first: the engine's reply to
    it follows a SchedulerStats that is current, so last_stats counts every step so far."""
    assert (await adm.get("/server_info")).status_code == 200
    stats = client.last_stats
    now = (stats.spec_decode_num_draft_tokens_total, stats.spec_decode_num_accepted_tokens_total)
    drafted, accepted = now[0] - since[0], now[1] - since[1]
    assert drafted > 0, "no drafts were verified"
    return accepted / drafted, now


async def test_draft_updates_through_the_control_plane(draft_pair, tmp_path_factory):
    target, draft = draft_pair
    root = str(tmp_path_factory.getbasetemp())  # holds both checkpoints
    config = EngineConfig.build(model=target, num_threads=1, num_blocks=24, max_num_seqs=4,
                                speculative_config={"method": "draft_model", "model": draft,
                                                    "num_speculative_tokens": 3}).resolve()
    actor_config = ActorConfig(config, Addresses.inproc())
    client = EngineClient(actor_config)
    status = EngineStatus(lambda: client.last_stats)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            await nursery.start(run_in_process, engine_specs(actor_config))
            data = DataPlaneEngine(client=client, tokenizer=load_tokenizer(target), served_model_name="m",
                                   max_model_len=config.max_model_len,
                                   vocab_size=load_model_config(target).vocab_size, engine_status=status.snapshot)
            admin = ControlPlaneEngine(client=client, engine_config=config, admin_token=TOKEN,
                                       weight_paths=WeightPathPolicy((root,)), status=status, drain_timeout_s=5.0)
            admin_port = await nursery.start(serve_admin_app, create_admin_app(admin), "127.0.0.1", 0)
            data_port = await nursery.start(serve_app, create_app(data), "127.0.0.1", 0)
            auth = {"Authorization": f"Bearer {TOKEN}"}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin_port}", headers=auth, timeout=60) as adm, \
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{data_port}", timeout=60) as http:
                await _check_updates(adm, http, client, target, draft)
            nursery.cancel_scope.cancel()
    finally:
        client.close()


async def _check_updates(adm, http, client, target: str, draft: str) -> None:
    reference = await _greedy(http, speculative=False)
    assert await _greedy(http, speculative=True) == reference
    perturbed, counters = await _acceptance(adm, client, (0, 0))
    assert perturbed < 1.0  # the perturbed draft is sometimes wrong

    # 1. The draft from disk: the target's own weights; the target's version does not move.
    reply = await adm.post("/update_weights_from_disk", json={"model_path": target, "draft_model_only": True,
                                                              "weight_version": "d1"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["draft_weight_version"] == "d1" and body["weight_version"] == "0"
    assert body["draft"]["weights"] == "updated" and body["draft"]["method"] == "draft_model"
    info = (await adm.get("/server_info")).json()
    assert info["weight_version"] == "0"
    assert info["engine_info"]["speculative"]["draft_weight_version"] == "d1"
    assert info["engine_info"]["speculative"]["draft_model_path"] == target
    assert await _greedy(http, speculative=True) == reference
    same, counters = await _acceptance(adm, client, counters)
    assert same == 1.0  # a draft identical to the target: every greedy draft is accepted

    # 2. Bad draft updates are 4xx and leave the draft serving as it was.
    name = "model.layers.0.mlp.down_proj.weight"
    bad = {name: torch.zeros(3, 3)}
    reply = await adm.post("/update_weights_from_tensor", params={"draft_model_only": "true"},
                           content=save(bad), headers={"Content-Type": "application/octet-stream"})
    assert reply.status_code == 400 and "shape" in reply.text, reply.text
    reply = await adm.post("/update_weights_from_tensor", params={"draft_model_only": "true"},
                           content=save({"model.layers.0.nope.weight": torch.zeros(2)}))
    assert reply.status_code == 400, reply.text
    reply = await adm.post("/update_weights_from_disk", json={"model_path": "/etc", "draft_model_only": True})
    assert reply.status_code == 403, reply.text
    assert await _greedy(http, speculative=True) == reference
    still, counters = await _acceptance(adm, client, counters)
    assert still == 1.0

    # 3. From tensors, through trillium.rlhf.WeightSync: the draft's own (perturbed) layers back.
    layers = {k: v for k, v in load_file(f"{draft}/model.safetensors").items() if "layers" in k}
    sync = WeightSync(str(adm.base_url), TOKEN)
    version = await trio.to_thread.run_sync(lambda: sync.push_tensors(layers, "d2", draft_model_only=True))
    assert version == "d2"
    assert await _greedy(http, speculative=True) == reference
    dropped, counters = await _acceptance(adm, client, counters)
    assert dropped < 1.0

    # 4. Routings not implemented: 400s naming the field.
    for params in ({"disable_draft_model": "false"}, {"draft_model_only": "true", "disable_draft_model": "true"}):
        reply = await adm.post("/update_weights_from_tensor", params=params, content=save(bad))
        assert reply.status_code == 400 and "disable_draft_model" in reply.text, reply.text
    reply = await adm.post("/update_weights_from_disk", json={"model_path": target, "disable_draft_model": False})
    assert reply.status_code == 400 and "disable_draft_model" in reply.text, reply.text
    reply = await adm.post("/update_weights_from_distributed", json={"names": ["x"], "dtypes": ["float32"],
                                                                     "shapes": [[1]], "draft_model_only": True})
    assert reply.status_code == 400 and "draft_model_only" in reply.text, reply.text

    # 5. A target update says what happened to the draft (kept weights, state flushed).
    reply = await adm.post("/update_weights_from_disk", json={"model_path": target, "weight_version": "t1"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["weight_version"] == "t1" and body["draft"]["weights"] == "kept" and body["draft"]["flushed"]
    info = (await adm.get("/server_info")).json()["engine_info"]["speculative"]
    assert info["draft_weight_version"] == "d2" and info["last_update"]["weights"] == "kept"
