"""`trillium serve --tensor-parallel-size 2` end to end, on CPU with gloo.

One server (module-scoped) on a checkpoint that has every feature the
sharding must get right at once: GQA with fewer KV heads than ranks (one KV
head, replicated), tied embeddings, q/k/v and o_proj biases (Qwen3's
`attention_bias`), q/k norms, and a vocabulary (509) that does not split
evenly (the last rank's rows padded). Its greedy tokens equal transformers'
(which also equal the one-rank engine's: tests/data_plane/test_generate.py)
and the top-5 logprobs agree within 1e-3, as vLLM's TP correctness tests
compare TP=2 against TP=1 (vllm-project/vllm, tests/distributed/
test_pipeline_parallel.py / tests/models/utils.py check_logprobs_close).
Sleep / wake, an update from disk and a trainer's distributed push (every
rank joins the group at rank_offset + tp_rank, SGLang's convention) run on
both ranks. A PEFT LoRA adapter loaded at run time (/v1/load_lora_adapter)
reaches both ranks, each keeping its shard (vLLM's layout: vllm-project/vllm,
vllm/lora/layers/column_parallel_linear.py and row_parallel_linear.py), and
its requests equal transformers + peft beside base requests in one batch. Last, a rank killed takes the
server down with a logged cause (the supervisor watches every rank). SGLang's /get_server_info
reports tp_size (sgl-project/sglang, python/sglang/srt/server_args.py
`tp_size`).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal

import pytest

from support.admin_server import API_KEY, AdminServer
from support.lora_adapters import ADAPTERS, make_peft_adapter
from support.oracles import hf_greedy, transformers_model

PROMPTS = [[5, 17, 99, 250, 31], [400, 3, 77, 12, 8, 190, 44], [9, 9, 300]]
N_TOKENS = 8
TP_MODEL = {"num_key_value_heads": 1, "tie_word_embeddings": True, "attention_bias": True, "vocab_size": 509}


@pytest.fixture(scope="module")
def weights(checkpoint):
    return {"base": checkpoint("qwen3", **TP_MODEL), "next": checkpoint("qwen3", seed=1, **TP_MODEL)}


@pytest.fixture(scope="module")
def adapter(weights, tmp_path_factory):
    """A PEFT adapter (r=16, rsLoRA) on all seven projections of the base checkpoint."""
    pytest.importorskip("peft")
    return make_peft_adapter(weights["base"], tmp_path_factory.mktemp("tp-lora") / "all", 3, **ADAPTERS["all"])


@pytest.fixture(scope="module")
def server(weights, adapter):
    root = str(weights["base"].parent.parent)
    proc = AdminServer(str(weights["base"]), "--tensor-parallel-size", "2", "--kv-cache-memory", "2MiB",
                       "--max-num-seqs", "8", "--allowed-weight-paths", root, "--enable-lora",
                       "--max-loras", "1", "--max-lora-rank", "16", "--allowed-lora-paths", str(adapter.parent),
                       ).wait_ready(timeout_s=300)
    proc.rank_killed = False
    yield proc
    code = proc.stop()
    assert code == 0 or proc.rank_killed, proc.log()


@pytest.fixture(scope="module")
def hf_reference(weights):
    out = {}
    for name, path in weights.items():
        model = transformers_model(path)
        out[name] = [hf_greedy(model, ids, N_TOKENS, top_n=5) for ids in PROMPTS]
    return out


def generate(server, ids, **extra) -> dict:
    body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 5, "logprob_start_len": 0,
            "sampling_params": {"temperature": 0, "max_new_tokens": N_TOKENS, "min_new_tokens": N_TOKENS}, **extra}
    response = server.http.post(server.base_url + "/generate", json=body,
                                headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200, response.text
    return response.json()


def assert_matches(out: dict, reference) -> None:
    tokens, tops = reference
    assert out["output_ids"] == tokens
    for top, (ids, logprobs) in zip(out["meta_info"]["output_top_logprobs"], tops):
        assert [e[1] for e in top] == ids
        assert [e[0] for e in top] == pytest.approx(logprobs, abs=1e-3)


def test_tp2_equals_transformers_concurrently(server, hf_reference):
    """Three prompts at once (one batch on both ranks, prompt logprobs gathered too)."""
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda ids: generate(server, ids), PROMPTS))
    for ids, out, reference in zip(PROMPTS, outs, hf_reference["base"]):
        assert_matches(out, reference)
        assert len(out["meta_info"]["input_token_logprobs"]) == len(ids)
    info = server.admin_ok("GET", "/get_server_info")
    assert info["tp_size"] == 2
    assert {"executor", "executor-rank1"} <= set(info["actors"])


def test_sleep_wake_and_update_from_disk_reach_every_rank(server, weights, hf_reference):
    try:
        server.admin_ok("POST", "/sleep", json={"level": 1})
        server.admin_ok("POST", "/wake_up")
        assert_matches(generate(server, PROMPTS[0]), hf_reference["base"][0])
        server.admin_ok("POST", "/update_weights_from_disk", json={"model_path": str(weights["next"])})
        assert_matches(generate(server, PROMPTS[1]), hf_reference["next"][1])
    finally:
        server.admin_ok("POST", "/update_weights_from_disk", json={"model_path": str(weights["base"])})


def test_trainer_push_reaches_every_rank(server, weights, hf_reference):
    """A trainer written as SGLang's RL test writes it (support/sglang_trainer.py: its group recipe
    and push), with world_size 1 + tp_size: every rank joins at rank_offset + tp_rank, receives the
    full tensors and keeps its slice. WHY the trainer in this process (the control-plane tests run
    it as a script): its torch and transformers imports are already paid here."""
    import httpx

    from support.sglang_trainer import GROUP_NAME, join_and_push
    from support.serve_process import free_port

    def init(world_size: int, port: int):
        return server.admin("POST", "/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world_size,
            "group_name": GROUP_NAME, "backend": "gloo", "timeout_s": 60})

    too_small = init(2, free_port())
    assert too_small.status_code == 400 and "tensor-parallel ranks" in too_small.text, too_small.text
    model = transformers_model(weights["next"])
    admin = httpx.Client(base_url=server.admin_url, headers={"Authorization": f"Bearer {server.token}"}, timeout=120)
    try:
        result = join_and_push(admin, init, free_port(), 3, model, "v-tp")
        assert result["init_status"] == 200, result["init_text"]
        assert (result["update_status"], result["destroy_status"]) == (200, 200), result
        assert_matches(generate(server, PROMPTS[2]), hf_reference["next"][2])
    finally:
        admin.close()
        server.admin_ok("POST", "/update_weights_from_disk", json={"model_path": str(weights["base"])})


def test_lora_adapter_loaded_at_run_time_reaches_every_rank(server, weights, adapter, hf_reference):
    from peft import PeftModel

    tuned = PeftModel.from_pretrained(transformers_model(weights["base"]), str(adapter)).eval()
    reference = [hf_greedy(tuned, ids, N_TOKENS, top_n=5) for ids in PROMPTS[:2]]
    assert [r[0] for r in reference] != [r[0] for r in hf_reference["base"][:2]]  # the adapter changes tokens
    server.admin_ok("POST", "/v1/load_lora_adapter", json={"lora_name": "tp-all", "lora_path": str(adapter)})
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # one batch: two adapter rows, one base row
            tuned = [pool.submit(generate, server, ids, lora_path="tp-all") for ids in PROMPTS[:2]]
            base = pool.submit(generate, server, PROMPTS[2])
            for out, ref in zip(tuned, reference):
                assert_matches(out.result(), ref)
            assert_matches(base.result(), hf_reference["base"][2])
    finally:
        server.admin_ok("POST", "/v1/unload_lora_adapter", json={"lora_name": "tp-all"})


def test_profile_writes_one_trace_per_rank(server):
    """/start_profile and /stop_profile reach both ranks; each writes its own torch.profiler trace
    named with its rank, and the reply lists both (SGLang's scheduler exports one trace per TP rank,
    `<time>-TP-<tp_rank>.trace.json.gz`: sgl-project/sglang, python/sglang/srt/managers/scheduler.py)."""
    server.admin_ok("POST", "/start_profile", json={"actors": ["executor"]})
    try:
        generate(server, PROMPTS[0])
    finally:
        files = server.admin_ok("POST", "/stop_profile")["files"]
    traces = sorted(os.path.basename(f).split("-")[1] for f in files if f.endswith(".pt.trace.json"))
    assert traces == ["rank0", "rank1"], files
    for path in files:
        assert os.path.getsize(path) > 0, path
    assert server.admin("POST", "/stop_profile").status_code == 409  # none runs now, on any rank


def test_a_dead_rank_stops_the_server(server):
    """Runs last: it ends the module's server."""
    from support.waiting import wait_until

    pid = server.admin_ok("GET", "/server_info")["actors"]["executor-rank1"]["pid"]
    server.rank_killed = True
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: server.process.poll() is not None, timeout_s=60, interval_s=0.2,
               what="the server to stop after its rank 1 died", detail=server.log)
    assert server.process.returncode != 0
    assert "executor-rank1" in server.log()
