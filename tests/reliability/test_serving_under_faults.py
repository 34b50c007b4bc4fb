"""Serving goes on through a trainer that never joins, and hang-ups at random points leak no KV block.

One real `trillium serve` with the stall watchdog at 2 s (so a frozen step
path would show as a stall within the window):

- A trainer's `/init_weights_update_group` whose trainer never joins (the
  rendezvous waits 8 s): 8 streaming clients keep receiving tokens the whole
  time, /health is 200 on both ports, /server_info names the group being
  formed, the watchdog counts no stall; the init answers 504. The join runs
  off the step path (trillium/actors/executor/group_join.py), as SGLang's
  does not need to (its rendezvous blocks the scheduler:
  sgl-project/sglang python/sglang/srt/managers/scheduler.py
  `init_weights_update_group` runs inline in the event loop).
- 100 clients that hang up at random points (seeded): after 0..max_tokens
  streamed chunks, right after the headers, or while waiting for a
  non-streamed answer; once they are gone nothing runs and
  `kv_cache_usage_perc` is back to 0 (every aborted request's blocks freed).
"""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from support.engine_faults import metric
from support.serve_process import ServeProcess, free_port
from support.waiting import wait_until

ADMIN_TOKEN = "serving-faults-admin"
NUM_STREAMS = 8
NUM_HANGUPS = 100
SEED = 16


@pytest.fixture(scope="module")
def server(checkpoint):
    proc = ServeProcess(str(checkpoint("llama", max_position_embeddings=8192)), "--kv-cache-memory", "16MiB",
                        "--executor-threads", "1", "--engine-stall-timeout-s", "2", "--max-num-seqs", "16",
                        env={"TRILLIUM_ADMIN_TOKEN": ADMIN_TOKEN}).wait_healthy(timeout_s=300)
    yield proc
    assert proc.stop() == 0, proc.log()


def admin(server, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, server.admin_url + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                         timeout=kwargs.pop("timeout", 30), **kwargs)


class Streams:
    """NUM_STREAMS clients streaming long completions one after another; the time of every chunk."""

    def __init__(self, server) -> None:
        self.stop = threading.Event()
        self.chunk_times: list[list[float]] = [[] for _ in range(NUM_STREAMS)]
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._run, args=(server.base_url, i), daemon=True)
                         for i in range(NUM_STREAMS)]
        for thread in self._threads:
            thread.start()

    def _run(self, base_url: str, index: int) -> None:
        body = {"model": "test-model", "prompt": f"Stream {index}", "max_tokens": 4000, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=base_url, timeout=60) as http:
            while not self.stop.is_set():
                with http.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        self.errors.append(f"{response.status_code} {response.read()[:200]!r}")
                        return
                    for line in response.iter_lines():
                        if '"error"' in line:
                            self.errors.append(line)
                        elif line.startswith("data: {"):
                            self.chunk_times[index].append(time.monotonic())
                        if self.stop.is_set():
                            break

    def close(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(60)

    def counts_between(self, start: float, end: float) -> list[int]:
        return [sum(start <= t <= end for t in times) for times in self.chunk_times]


def test_streams_keep_generating_while_a_trainer_never_joins(server):
    streams = Streams(server)
    try:
        wait_until(lambda: all(streams.chunk_times), timeout_s=60, interval_s=0.05, what="every stream to produce")
        answer: dict = {}

        def init() -> None:
            answer["posted"] = time.monotonic()
            answer["response"] = admin(server, "POST", "/init_weights_update_group", timeout=120, json={
                "master_address": "127.0.0.1", "master_port": free_port(), "timeout_s": 8})
            answer["answered"] = time.monotonic()

        thread = threading.Thread(target=init)
        thread.start()
        polls = []
        while thread.is_alive():
            statuses = (httpx.get(server.base_url + "/health", timeout=10).status_code,
                        admin(server, "GET", "/health").status_code)
            forming = admin(server, "GET", "/server_info").json()["engine_info"]["weights_update_group_forming"]
            polls.append((time.monotonic(), statuses, forming))
            time.sleep(0.25)
        thread.join()
    finally:
        streams.close()
    assert answer["response"].status_code == 504, answer["response"].text
    window = (answer["posted"] + 0.5, answer["answered"] - 0.5)
    assert window[1] - window[0] > 5
    assert min(streams.counts_between(*window)) >= 5, streams.counts_between(*window)
    during = [(statuses, forming) for at, statuses, forming in polls if window[0] <= at <= window[1]]
    assert during and all(statuses == (200, 200) for statuses, _ in during), polls
    assert all(forming == "weight_update_group" for _, forming in during), polls
    assert not streams.errors, streams.errors[:3]
    for actor in ("executor", "detokenizer", "scheduler"):
        assert metric(server, "trillium:engine_stalls_total", actor=actor) == 0


def hang_up(base_url: str, rng: random.Random) -> str:
    """One client that leaves early; which way it left."""
    max_tokens = rng.randint(8, 200)
    body = {"model": "test-model", "prompt": f"Hang up {rng.randrange(10_000)}", "max_tokens": max_tokens,
            "ignore_eos": True}
    way = rng.choice(["stream", "stream", "stream", "headers", "waiting"])
    if way == "waiting":  # a non-streamed request whose client gives up before the answer
        try:
            httpx.post(base_url + "/v1/completions", json={**body, "max_tokens": 4000},
                       timeout=httpx.Timeout(30, read=rng.uniform(0.01, 0.3)))
        except httpx.ReadTimeout:
            pass
        return way
    leave_after = 0 if way == "headers" else rng.randint(1, max_tokens)
    with httpx.Client(base_url=base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            chunks = 0
            for line in response.iter_lines():
                if chunks >= leave_after:
                    break
                chunks += line.startswith("data: {")
    return way


def test_hang_ups_at_random_points_leak_no_kv_block(server):
    rng = random.Random(SEED)
    seeds = [rng.randrange(1 << 30) for _ in range(NUM_HANGUPS)]
    ways: list[str] = []

    def worker(chunk: list[int]) -> None:
        for seed in chunk:
            ways.append(hang_up(server.base_url, random.Random(seed)))

    threads = [threading.Thread(target=worker, args=(seeds[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert len(ways) == NUM_HANGUPS and {"stream", "headers", "waiting"} <= set(ways)
    wait_until(lambda: metric(server, "trillium:num_requests_running") == 0
               and metric(server, "trillium:num_requests_waiting") == 0
               and metric(server, "trillium:kv_cache_usage_perc") == 0,
               timeout_s=60, interval_s=0.1, what="every hung-up request to be aborted and its blocks freed")
    info = admin(server, "GET", "/server_info").json()["engine_info"]
    assert info["num_running"] == 0 and info["kv_usage"] == 0
    ok = httpx.post(server.base_url + "/v1/completions", timeout=60,
                    json={"model": "test-model", "prompt": "Once", "max_tokens": 4})
    assert ok.status_code == 200
