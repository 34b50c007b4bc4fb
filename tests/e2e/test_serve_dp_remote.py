"""Data-parallel replicas on two "hosts" over loopback tcp://: an api host with one local replica and a
`--headless` host with one more, joined by the api host's join socket.

The shape is vLLM's multi-node data parallelism (vllm-project/vllm, vllm/engine/arg_utils.py
`--data-parallel-size-local`, `--data-parallel-start-rank`, `--data-parallel-address`,
`--data-parallel-rpc-port`; vllm/entrypoints/cli/serve.py `run_headless`; the handshake on the rpc
port in vllm/v1/engine/utils.py `launch_core_engines`): the api host runs replica 0 and the api,
the headless host (another `trillium serve` process, as on another host) runs replica 1, both read
the same `--link-secret-file`.

- requests spread over both replicas and their greedy tokens equal transformers'; a conversation's
  turns stay on one replica; /server_info lists replica 1 as remote (tcp://); a weight update from
  disk reaches both (one version);
- peers without the secret at the api host's join socket, at replica 1's api inbox and at the
  headless host's scheduler inbox get nothing served and are counted (engine_rejected_frames_total);
- last: the headless host killed mid-stream -> only its stream ends with an error, the local
  replica's finishes, and the api keeps serving on it.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading

import httpx
import pytest
import zmq

from support.admin_server import API_KEY
from support.oracles import hf_greedy, transformers_model
from support.serve_process import child_pids, free_port, is_alive
from support.two_hosts import headless_beside, link_secret_file
from support.waiting import wait_until

PROMPTS = [[5, 17, 99, 250, 31], [400, 3, 77, 12, 8, 190, 44], [9, 9, 300], [61, 2, 480, 7]]
N_TOKENS = 8
MODEL = {"num_key_value_heads": 1, "tie_word_embeddings": True, "attention_bias": True, "vocab_size": 509}


def _rpc_port() -> int:
    """A free port P whose P + 1 (replica 1's api inbox) is free too."""
    import socket

    while True:
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


@pytest.fixture(scope="module")
def model_path(checkpoint):
    return checkpoint("qwen3", **MODEL)


@pytest.fixture(scope="module")
def deployment(model_path, tmp_path_factory):
    secret = link_secret_file(tmp_path_factory.mktemp("dp-remote"))
    rpc_port = _rpc_port()
    common = ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address",
              "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port), "--link-secret-file", str(secret),
              "--kv-cache-memory", "2MiB", "--max-num-seqs", "8", "--executor-threads", "1"]
    with headless_beside(model_path, common, ["--data-parallel-start-rank", "1"],
                         ["--allowed-weight-paths", str(model_path.parent)],
                         f"/tmp/trillium-dp-headless-{rpc_port}.log") as api:
        api.rpc_port = rpc_port
        yield api
    assert api.exit_code == 0, api.log()


def generate(server, ids, n_tokens=N_TOKENS) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n_tokens,
                                                  "min_new_tokens": n_tokens}}
    return server.http.post(server.base_url + "/generate", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                            timeout=120)


def replicas(server) -> list[dict]:
    return server.admin_ok("GET", "/server_info")["replicas"]


def rejected(server) -> dict[tuple[str, str], float]:
    """engine_rejected_frames_total by (actor, engine label or "")."""
    out: dict[tuple[str, str], float] = {}
    for line in server.admin("GET", "/metrics").text.splitlines():
        if line.startswith("trillium:engine_rejected_frames_total{"):
            labels = line.split("{", 1)[1].split("}", 1)[0]
            actor = labels.split('actor="')[1].split('"')[0]
            engine = labels.split('engine="')[1].split('"')[0] if 'engine="' in labels else ""
            out[(actor, engine)] = out.get((actor, engine), 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_both_hosts_serve_transformers_greedy_tokens(deployment, model_path):
    model = transformers_model(model_path)
    prompts = PROMPTS * 2
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda ids: generate(deployment, ids), prompts))
    for ids, response in zip(prompts, responses):
        assert response.status_code == 200, response.text
        assert response.json()["output_ids"] == hf_greedy(model, ids, N_TOKENS, top_n=1)[0]
    info = replicas(deployment)
    assert [r["replica"] for r in info] == [0, 1] and all(r["serving"] for r in info)
    assert info[0]["remote"] is None and info[1]["remote"].startswith("tcp://127.0.0.1:")
    assert min(r["num_routed_requests"] for r in info) >= 2, info
    # Prefix affinity across hosts alike: a conversation's turns (two shared 16-token blocks) stay on one replica.
    before = [r["num_routed_requests"] for r in info]
    for turn in range(3):
        assert generate(deployment, list(range(40, 72)) + [7] * turn, n_tokens=2).status_code == 200
    grew = [r["num_routed_requests"] - b for r, b in zip(replicas(deployment), before)]
    assert sorted(grew) == [0, 3], grew
    # A control command reaches the headless host's replica too: one version for the server.
    deployment.admin_ok("POST", "/update_weights_from_disk",
                        json={"model_path": str(model_path), "weight_version": "v-remote"})
    assert [r["weight_version"] for r in replicas(deployment)] == ["v-remote", "v-remote"]
    assert generate(deployment, PROMPTS[0]).json()["output_ids"] == hf_greedy(model, PROMPTS[0], N_TOKENS, 1)[0]


def test_peers_without_the_secret_are_refused_and_counted(deployment):
    from trillium.actors.link_auth import LinkKey, Signer

    scheduler = replicas(deployment)[1]["remote"]
    before = rejected(deployment)
    routed = sum(r["num_routed_requests"] for r in replicas(deployment))
    forged = Signer(LinkKey.generate(), "api").sign([b"not a request"])  # another deployment's secret
    context = zmq.Context.instance()
    targets = {("dp-join", ""): f"tcp://127.0.0.1:{deployment.rpc_port}",
               ("api", "1"): f"tcp://127.0.0.1:{deployment.rpc_port + 1}", ("scheduler", "1"): scheduler}
    for address in targets.values():
        with context.socket(zmq.PUSH) as stranger:
            stranger.setsockopt(zmq.LINGER, 2000)
            stranger.connect(address)
            stranger.send_multipart(forged)
            stranger.send_multipart([b"no proof at all", b"x"])

    def counted() -> bool:
        now = rejected(deployment)
        return all(now.get(key, 0) >= before.get(key, 0) + 2 for key in targets)

    wait_until(counted, timeout_s=30, interval_s=0.2, what="the strangers' frames to be counted",
               detail=lambda: str(rejected(deployment)))
    assert sum(r["num_routed_requests"] for r in replicas(deployment)) == routed  # nothing was served
    assert all(r["serving"] for r in replicas(deployment))
    assert "refused" in deployment.log()


def _stream(server, ids, result) -> None:
    body = {"model": "cp-model", "prompt": ids, "max_tokens": 240, "ignore_eos": True, "temperature": 0,
            "stream": True}
    events = result["events"] = []
    with server.http.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120,
                            headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        result["status"] = response.status_code
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.replace(" ", ""))


def test_a_dead_headless_host_fails_only_its_requests(deployment, model_path):
    """Runs last: it ends the headless host. Two long streams, one per replica (routed by load)."""
    actors = child_pids(deployment.headless.pid)
    assert len(actors) == 3, actors  # its replica's scheduler, executor, detokenizer
    results = [{}, {}]
    threads = [threading.Thread(target=_stream, args=(deployment, ids, result), daemon=True)
               for ids, result in zip(PROMPTS[:2], results)]
    for thread in threads:
        thread.start()
    wait_until(lambda: all(len(r.get("events", ())) >= 2 for r in results), timeout_s=60, interval_s=0.05,
               what="both streams to start", detail=lambda: str([r.get("status") for r in results]))
    deployment.headless.kill()
    for pid in actors:
        os.kill(pid, signal.SIGKILL)
    for thread in threads:
        thread.join(120)
    lasts = [[e for e in r["events"] if e != "data:[DONE]"][-1] for r in results]
    failed = [last for last in lasts if '"error"' in last]
    finished = [r for r in results if any('"finish_reason":"length"' in e for e in r["events"])]
    assert len(failed) == 1 and len(finished) == 1, lasts
    assert "engine_failed" in failed[0], failed
    wait_until(lambda: not any(is_alive(pid) for pid in actors), timeout_s=30, interval_s=0.2,
               what="the headless host's actors to exit")
    info = replicas(deployment)
    assert info[0]["serving"] and not info[1]["serving"] and "tcp://" in info[1]["failure"], info
    model = transformers_model(model_path)
    for ids in PROMPTS[:2]:  # the api keeps serving, on replica 0
        response = generate(deployment, ids)
        assert response.status_code == 200, response.text
        assert response.json()["output_ids"] == hf_greedy(model, ids, N_TOKENS, top_n=1)[0]
    assert deployment.process.poll() is None
