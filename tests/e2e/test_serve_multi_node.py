"""Two "hosts" on loopback: `trillium serve --nnodes 2`, node 1 `--headless`, TP=2 over gloo.

The shape is vLLM's multi-node serving without Ray (vllm-project/vllm,
vllm/entrypoints/cli/serve.py `run_headless`: a node with `--headless`
and `--node-rank` >= 1 runs only its workers, joined at `--master-addr`:
`--master-port`; flags from vllm/engine/arg_utils.py `--nnodes`,
`--node-rank`, `--master-addr`, `--master-port`): node 0 is an ordinary
`trillium serve` running the api, the scheduler, the detokenizer and
executor rank 0; node 1 (another `trillium serve` process, as on another
host) runs executor rank 1. Both read the same `--link-secret-file`.

- greedy tokens and top-5 logprobs equal transformers' (the single-host TP=2
  test, tests/e2e/test_serve_tensor_parallel.py, asserts the same on this
  checkpoint);
- rank 0's store listens on `--master-addr` only, not on every interface;
- last: node 1 killed (its supervisor and rank) -> the next request gets an
  error response (not a hang) and node 0 stops with the cause logged.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from support.admin_server import API_KEY
from support.oracles import hf_greedy, transformers_model
from support.serve_process import child_pids, free_port, is_alive
from support.two_hosts import headless_beside, headless_log, link_secret_file
from support.waiting import wait_until

PROMPTS = [[5, 17, 99, 250, 31], [400, 3, 77, 12, 8, 190, 44], [9, 9, 300]]
N_TOKENS = 8
# The single-host TP test's checkpoint (one KV head replicated, tied embeddings, biases, q/k norms, 509 rows).
TP_MODEL = {"num_key_value_heads": 1, "tie_word_embeddings": True, "attention_bias": True, "vocab_size": 509}


@pytest.fixture(scope="module")
def model_path(checkpoint):
    return checkpoint("qwen3", **TP_MODEL)


@pytest.fixture(scope="module")
def deployment(model_path, tmp_path_factory):
    secret = link_secret_file(tmp_path_factory.mktemp("multi-node"))
    master_port = free_port()
    common = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(master_port), "--link-secret-file", str(secret),
              "--kv-cache-memory", "2MiB", "--max-num-seqs", "8"]
    with headless_beside(model_path, common, ["--node-rank", "1"], ["--node-rank", "0"],
                         f"/tmp/trillium-headless-{master_port}.log") as head:
        head.master_port = master_port
        yield head


def generate(server, ids) -> httpx.Response:
    body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 5,
            "sampling_params": {"temperature": 0, "max_new_tokens": N_TOKENS, "min_new_tokens": N_TOKENS}}
    return server.http.post(server.base_url + "/generate", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                            timeout=120)


def test_two_hosts_serve_transformers_greedy_tokens(deployment, model_path):
    model = transformers_model(model_path)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(lambda ids: generate(deployment, ids), PROMPTS))
    for ids, response in zip(PROMPTS, responses):
        assert response.status_code == 200, response.text
        out = response.json()
        tokens, tops = hf_greedy(model, ids, N_TOKENS, top_n=5)
        assert out["output_ids"] == tokens
        for top, (top_ids, logprobs) in zip(out["meta_info"]["output_top_logprobs"], tops):
            assert [e[1] for e in top] == top_ids
            assert [e[0] for e in top] == pytest.approx(logprobs, abs=1e-3)
    info = deployment.admin_ok("GET", "/get_server_info")
    assert info["tp_size"] == 2
    assert "executor" in info["actors"] and "executor-rank1" not in info["actors"]  # rank 1 is node 1's
    head, remote = info["tp_ranks"]  # /server_info lists the other host's rank too, unpolled
    assert head == {"rank": 0, "node": 0, "local": True, "actor": "executor",
                    "pid": info["actors"]["executor"]["pid"], "alive": True}
    assert remote == {"rank": 1, "node": 1, "local": False, "actor": None, "pid": None, "alive": None}
    assert "members proved" in headless_log(deployment)


def test_the_store_listens_on_the_master_address_only(deployment):
    """/proc/net/tcp: the LISTEN socket on the master port is bound to 127.0.0.1, not 0.0.0.0 / ::."""
    port = f"{deployment.master_port:04X}"
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and local.endswith(":" + port):
                    listening.append(local.rsplit(":", 1)[0])
    assert listening == ["0100007F"], listening


def test_a_dead_headless_node_fails_requests_and_stops_the_head(deployment):
    """Runs last: it ends the module's deployment. A streamed completion is running when node 1
    dies: its stream ends with an error event (not a hang), and node 0 stops with the cause."""
    ranks = child_pids(deployment.headless.pid)
    assert ranks, "node 1 runs its rank as a child process"
    body = {"model": "cp-model", "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "temperature": 0,
            "stream": True}
    events = []
    with deployment.http.stream("POST", deployment.base_url + "/v1/completions", json=body, timeout=120,
                                headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line)
            if len(events) == 2:
                deployment.headless.kill()  # SIGKILL its supervisor: its rank sees its stdin close and exits
    last = [e for e in events if e != "data: [DONE]"][-1]
    assert '"error"' in last and "engine_failed" in last, events[-3:]
    assert not any('"finish_reason":"length"' in e.replace(" ", "") for e in events), events[-3:]
    wait_until(lambda: not any(is_alive(pid) for pid in ranks), timeout_s=30, interval_s=0.2,
               what="node 1's rank to exit")
    wait_until(lambda: deployment.process.poll() is not None, timeout_s=60, interval_s=0.2,
               what="node 0 to stop after node 1 died", detail=deployment.log)
    assert deployment.process.returncode != 0
    assert "executor failed" in deployment.log() and "by peer" in deployment.log(), deployment.log()
