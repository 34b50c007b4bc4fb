"""A trainer written for SGLang pushes weights into `trillium serve` unchanged.

The trainer (`support/sglang_trainer.py`) mirrors the trainer side of
sgl-project/sglang test/srt/rl/test_update_weights_from_distributed.py and
forms its group with the `init_custom_process_group` recipe of
sgl-project/sglang python/sglang/srt/utils/common.py (torch's
`_new_process_group_helper`, store prefixes included); it never imports
Trillium. The engine side is Trillium's
(`trillium/distributed/update_group.py`, run by the executor as SGLang's
model_runner.py `init_weights_update_group` runs it: rank = rank_offset).

1. It joins, broadcasts the "next" checkpoint after POSTing
   /update_weights_from_distributed {names, dtypes, shapes, group_name,
   weight_version}; the next greedy outputs equal `transformers` on "next".
2. While the engine waits for a trainer that joins late (or never), four
   streaming clients keep receiving tokens and /health answers 200: the
   join runs off the step path, so the 200 is the truth.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from support import sglang_trainer
from support.admin_server import API_KEY, MAX_TOKENS, MODEL_NAME, PROMPTS, free_port
from support.oracles import transformers_model

TRAINER = sglang_trainer.__file__  # run as a script: the trainer is its own process
NUM_STREAMS = 4


def run_trainer(server, checkpoint, version: str, *extra: str, timeout_s: float = 180) -> dict:
    run = subprocess.run(
        [sys.executable, TRAINER, server.admin_url, server.token, str(checkpoint), version, str(free_port()), *extra],
        capture_output=True, text=True, timeout=timeout_s,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def greedy_by_ids(server, prompts_ids: list[list[int]]) -> list[str]:
    return [server.complete(ids, MAX_TOKENS).json()["choices"][0]["text"] for ids in prompts_ids]


@torch.inference_mode()
def transformers_greedy(checkpoint) -> tuple[list[list[int]], list[str]]:
    """PROMPTS as token ids, and `transformers`' greedy continuation of each as text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = transformers_model(checkpoint)
    prompts_ids, texts = [], []
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, do_sample=False)
        prompts_ids.append(ids)
        texts.append(tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True))
    return prompts_ids, texts


@pytest.mark.heavy
def test_cp_sglang_style_trainer_pushes_weights(server, weights_root, restore_base):
    prompts_ids, expected = transformers_greedy(weights_root / "next")
    assert greedy_by_ids(server, prompts_ids) != expected, "serving base: the push must change the outputs"
    result = run_trainer(server, weights_root / "next", "v-sglang")
    assert (result["init_status"], result["update_status"], result["destroy_status"]) == (200, 200, 200), result
    assert result["weight_version"] == "v-sglang"
    assert server.admin_ok("GET", "/weight_version") == {"weight_version": "v-sglang"}
    assert greedy_by_ids(server, prompts_ids) == expected
    assert server.admin_ok("GET", "/server_info")["engine_info"]["weights_update_group"] is None


class Streams:
    """NUM_STREAMS clients, each streaming one long completion after another; the
    wall-clock time of every chunk they receive (503s during an update are retried)."""

    def __init__(self, server) -> None:
        self.server = server
        self.stop = threading.Event()
        self.chunk_times: list[list[float]] = [[] for _ in range(NUM_STREAMS)]
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(NUM_STREAMS)]

    def __enter__(self) -> "Streams":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)

    def _run(self, index: int) -> None:
        body = {"model": MODEL_NAME, "prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": 200,
                "temperature": 0, "ignore_eos": True, "stream": True}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=self.server.base_url, headers=headers, timeout=60) as http:
            while not self.stop.is_set():
                with http.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        time.sleep(0.05)
                        continue
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            self.chunk_times[index].append(time.time())
                        if self.stop.is_set():
                            break

    def counts_between(self, start: float, end: float) -> list[int]:
        return [sum(start <= t <= end for t in times) for times in self.chunk_times]


@pytest.mark.parametrize("mode", ["joins-late", "never-joins"])
def test_cp_engine_keeps_generating_while_the_join_waits(server, weights_root, mode):
    late = ("--join-delay-s", "4", "--timeout-s", "60", "--join-only")
    extra = late if mode == "joins-late" else ("--never-join", "--timeout-s", "4")
    polls: list[tuple[float, tuple[int, int], object]] = []  # (time, /health statuses, group forming)
    with Streams(server) as streams:
        deadline = time.monotonic() + 60
        while not all(streams.chunk_times) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(streams.chunk_times), "every stream is producing before the trainer starts"
        trainer = subprocess.Popen(
            [sys.executable, TRAINER, server.admin_url, server.token, str(weights_root / "next"), "v-late",
             str(free_port()), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        while trainer.poll() is None:
            at = time.time()
            statuses = (server.http.get(server.base_url + "/health").status_code,
                        server.admin("GET", "/health").status_code)
            info = server.admin_ok("GET", "/server_info")["engine_info"]
            polls.append((at, statuses, info["weights_update_group_forming"]))
            time.sleep(0.2)
        stdout, stderr = trainer.communicate(timeout=60)
    assert trainer.returncode == 0, stderr[-4000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    if mode == "joins-late":
        assert (result["init_status"], result["destroy_status"]) == (200, 200), result
        assert result["init_answered_at"] >= result["joining_at"], "answered once the trainer joined"
        waited_until = result["joining_at"]
    else:
        assert result["init_status"] == 504, result
        assert result["init_answered_at"] - result["init_posted_at"] >= 4
        waited_until = result["init_answered_at"]
    # The engine waited for the trainer from the init's arrival to `waited_until`:
    # every stream kept receiving tokens in that window, and /health said 200.
    window = (result["init_posted_at"] + 0.5, waited_until - 0.2)
    assert window[1] - window[0] > 2
    assert min(streams.counts_between(*window)) >= 5, streams.counts_between(*window)
    during = [(statuses, forming) for at, statuses, forming in polls if window[0] <= at <= window[1]]
    assert during and all(statuses == (200, 200) for statuses, _ in during), polls
    assert all(forming == "test_parameter_update_group" for _, forming in during), "server_info says so too"
    assert server.admin_ok("GET", "/server_info")["engine_info"]["weights_update_group"] is None
