"""`trillium serve --data-parallel-size 2`: two engine replicas behind one api, end to end.

One real server (module-scoped) on the "base" checkpoint of the control-plane
weights root. 32 greedy requests spread over both replicas (/server_info's
routed counts, /metrics' request_success_total by `engine`) and equal
`trillium.LLM` (one engine) token for token; a conversation's turns all go
to one replica, where their prefix is cached; a weight update from disk
under load reaches both replicas with no response mixing versions, and
every later request runs on the new weights; a trainer's distributed push
(every replica's ranks in its one group) reaches both replicas; /v1/loads lists a dp_rank per replica; an executor that
dies takes only its replica down.

Mirrors: vLLM's data-parallel metrics label every series with
["model_name", "engine"] (vllm-project/vllm, vllm/v1/metrics/loggers.py,
PrometheusStatLogger); SGLang's /get_server_info reports "dp_size"
(sgl-project/sglang, python/sglang/srt/server_args.py) and /v1/loads one
entry per dp_rank (python/sglang/srt/entrypoints/v1_loads.py).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from support.admin_server import MAX_TOKENS, MODEL_NAME, PROMPTS, AdminServer
from support.update_load import UpdateLoad
from support.waiting import wait_until


@pytest.fixture(scope="module")
def dp_server(weights_root):
    proc = AdminServer(str(weights_root / "base"), "--data-parallel-size", "2",
                       "--allowed-weight-paths", str(weights_root), "--kv-cache-memory", "8MiB",
                       "--max-num-seqs", "16").wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


def routed(server) -> list[int]:
    return [r["num_routed_requests"] for r in server.admin_ok("GET", "/server_info")["replicas"]]


def successes_by_engine(server) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in server.admin("GET", "/metrics").text.splitlines():
        if line.startswith("trillium:request_success_total{"):
            engine = line.split('engine="')[1].split('"')[0]
            out[engine] = out.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_cp_dp_spreads_32_requests_and_matches_one_engine(dp_server, references):
    info = dp_server.admin_ok("GET", "/get_server_info")
    assert info["dp_size"] == 2 and [r["replica"] for r in info["replicas"]] == [0, 1]
    assert set(info["actors"]) == {f"{a}@{i}" for a in ("executor", "scheduler", "detokenizer") for i in (0, 1)}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    response = dp_server.complete(prompts, MAX_TOKENS)
    assert response.status_code == 200, response.text
    texts = [c["text"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]
    assert texts == [references["base"][i % len(PROMPTS)] for i in range(32)]
    counts = routed(dp_server)
    assert sum(counts) >= 32 and min(counts) >= 8, counts
    by_engine = successes_by_engine(dp_server)
    assert set(by_engine) == {"0", "1"} and min(by_engine.values()) >= 8, by_engine
    loads = dp_server.admin_ok("GET", "/v1/loads")
    assert loads["dp_rank_count"] == 2 and [one["dp_rank"] for one in loads["loads"]] == [0, 1]
    assert [one["dp_rank"] for one in dp_server.admin_ok("GET", "/v1/loads?dp_rank=1")["loads"]] == [1]
    assert dp_server.admin("GET", "/v1/loads?dp_rank=2").status_code == 400


def test_cp_dp_conversation_turns_stay_on_one_replica(dp_server):
    messages = [{"role": "user", "content": "Tell me a long story about a dog, a cat and a very old tree"}]
    before = routed(dp_server)
    for turn in range(3):
        body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 6, "temperature": 0}
        reply = dp_server.http.post(dp_server.base_url + "/v1/chat/completions", json=body,
                                    headers={"Authorization": "Bearer sk-data-plane-key"})
        assert reply.status_code == 200, reply.text
        if turn:
            assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": f"And then {turn}?"}]
    grew = [after - b for after, b in zip(routed(dp_server), before)]
    assert sorted(grew) == [0, 3], grew


def test_cp_dp_trainer_push_reaches_every_replica(dp_server, weights_root, references):
    """A trainer written as SGLang's RL test writes it (support/sglang_trainer.py: its group recipe and
    push), sized for the whole server as slime sizes its group for N engines (THUDM/slime,
    slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py: world_size
    N * gpus + 1, engine i at rank_offset i * gpus + 1): world_size 3, replica i joins at 1 + i. One
    broadcast per tensor reaches both replicas; after the call returns both serve the new version.
    WHY the trainer in this process: torch (and LLM, for the references) are loaded here already."""
    import httpx

    from support.oracles import transformers_model
    from support.serve_process import free_port
    from support.sglang_trainer import GROUP_NAME, join_and_push

    def init(world_size: int, port: int):
        return dp_server.admin("POST", "/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world_size,
            "group_name": GROUP_NAME, "backend": "gloo", "timeout_s": 60})

    too_small = init(2, free_port())  # the one-engine recipe's world: no room for replica 1
    assert too_small.status_code == 400 and "--data-parallel-size 2" in too_small.text, too_small.text
    model = transformers_model(weights_root / "next")
    admin = httpx.Client(base_url=dp_server.admin_url, headers={"Authorization": f"Bearer {dp_server.token}"},
                         timeout=120)
    try:
        result = join_and_push(admin, init, free_port(), 3, model, "dp-dist")
        assert result["init_status"] == 200, result["init_text"]
        assert (result["update_status"], result["destroy_status"]) == (200, 200), result
        replicas = dp_server.admin_ok("GET", "/server_info")["replicas"]
        assert [r["weight_version"] for r in replicas] == ["dp-dist"] * 2
        before = routed(dp_server)
        response = dp_server.complete([PROMPTS[i % len(PROMPTS)] for i in range(8)], MAX_TOKENS)
        assert response.status_code == 200, response.text
        texts = [c["text"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]
        assert texts == [references["next"][i % len(PROMPTS)] for i in range(8)]
        assert min(a - b for a, b in zip(routed(dp_server), before)) > 0  # both replicas answered
    finally:
        admin.close()
        dp_server.admin_ok("POST", "/update_weights_from_disk", json={"model_path": str(weights_root / "base")})


def test_cp_dp_update_under_load_is_one_version(dp_server, weights_root, references):
    old = dp_server.admin_ok("GET", "/weight_version")["weight_version"]
    load = UpdateLoad(dp_server, num_workers=8)
    for thread in load.threads:
        thread.start()
    try:
        load.wait_for(8)
        dp_server.admin_ok("POST", "/update_weights_from_disk",
                           json={"model_path": str(weights_root / "next"), "weight_version": "dp-next"})
        returned_s = time.monotonic()
        before = routed(dp_server)
        load.wait_for(16, since_s=returned_s)
    finally:
        load.stop.set()
        for thread in load.threads:
            thread.join(60)
    expected = {old: references["base"], "dp-next": references["next"]}
    for record in load.records:
        assert record["versions"] == {record["header"]}, record  # exactly one version per response
        assert record["text"] == expected[record["header"]][record["prompt_index"]], record
        if record["started_s"] > returned_s:
            assert record["header"] == "dp-next", record
    assert min(a - b for a, b in zip(routed(dp_server), before)) > 0  # both replicas served the new weights
    assert [r["weight_version"] for r in dp_server.admin_ok("GET", "/server_info")["replicas"]] == ["dp-next"] * 2


def test_cp_dp_dead_replica_leaves_the_other_serving(dp_server, references):
    """Last in the module: it takes replica 1 down for good."""
    info = dp_server.admin_ok("GET", "/server_info")
    os.kill(info["actors"]["executor@1"]["pid"], signal.SIGKILL)

    def replica_down() -> bool:
        return not dp_server.admin_ok("GET", "/server_info")["replicas"][1]["serving"]

    wait_until(replica_down, timeout_s=60, interval_s=0.1, what="replica 1 to be taken out")
    wait_until(lambda: dp_server.http.get(dp_server.base_url + "/health").status_code == 200, timeout_s=30,
               interval_s=0.1, what="/health to be 200 again")
    version = dp_server.admin_ok("GET", "/weight_version")["weight_version"]
    expected = references["next" if version == "dp-next" else "base"]
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(dp_server.greedy(PROMPTS))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == [expected, expected]
    assert "replica 1" in (dp_server.admin_ok("GET", "/server_info")["replicas"][1]["failure"] or "")
