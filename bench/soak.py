"""Soak test: a bounded, loopback-only mixed load with faults against a real `trillium serve`.

Run: .venv/bin/python bench/soak.py [--minutes 2] [--clients 8] [--seed 0] [--model PATH]

For --minutes, --clients threads send completions (streamed and not,
completions and chat; a third of the streams hang up at a random chunk),
while a control thread, every few seconds, does one of: sleep level 1 and
wake, pause (keep) and resume, a weight update from disk (the served
checkpoint again), a weight update from an uploaded safetensors file (the
final norm of the checkpoint), a reset of the prefix cache; the time between
actions and every choice are drawn from --seed. Nothing leaves 127.0.0.1.

At the end it waits for the engine to go idle and prints:
  requests served (by kind), errors by kind (HTTP status + error code, or
  the exception of a cut connection; 503s while asleep / paused / updating
  are expected and listed apart), control actions run, and KV blocks
  leaked: device blocks still held by requests once none runs (must be 0;
  `/server_info` num_blocks - num_free_blocks). Exit code 1 when blocks
  leaked or a request met an unexpected error.

Without --model it builds the synthetic llama checkpoint (long context) in
a temp dir: the numbers measure the server's bookkeeping, not a model.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

TOKEN = "soak-admin-token"
MODEL_NAME = "soak-model"
EXPECTED_503 = ("engine_sleeping", "engine_paused", "engine_updating_weights", "engine_draining", "server_overloaded")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.served = collections.Counter()
        self.errors = collections.Counter()
        self.expected = collections.Counter()
        self.actions = collections.Counter()

    def add(self, counter: str, key: str) -> None:
        with self.lock:
            getattr(self, counter)[key] += 1


def error_kind(response: httpx.Response | None, event: dict | None = None) -> tuple[str, bool]:
    """("<status> <code>" of an error response, or "sse <code>" of a stream's error event; expected?)."""
    body = event
    if body is None:
        try:
            body = response.json()
        except ValueError:
            body = {}
    code = (body or {}).get("error", {}).get("code")
    where = "sse" if event is not None else str(response.status_code)
    return f"{where} {code}", code in EXPECTED_503


def client_loop(base_url: str, rng: random.Random, deadline: float, tally: Tally) -> None:
    with httpx.Client(base_url=base_url, timeout=120) as http:
        while time.monotonic() < deadline:
            kind = rng.choice(["stream", "stream-hangup", "complete", "chat"])
            max_tokens = rng.randint(4, 96)
            try:
                if kind == "chat":
                    response = http.post("/v1/chat/completions", json={
                        "model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 1.0, "seed": rng.randrange(1 << 30),
                        "messages": [{"role": "user", "content": f"Tell me about {rng.randrange(1000)}"}]})
                    record(response, kind, tally)
                elif kind == "complete":
                    response = http.post("/v1/completions", json={
                        "model": MODEL_NAME, "prompt": f"Once upon a time {rng.randrange(1000)}",
                        "max_tokens": max_tokens, "n": rng.choice([1, 1, 2])})
                    record(response, kind, tally)
                else:
                    stream(http, kind, max_tokens, rng, tally)
            except httpx.HTTPError as exc:
                tally.add("errors", f"{kind}: {type(exc).__name__}")
            time.sleep(rng.random() * 0.05)


def record(response: httpx.Response, kind: str, tally: Tally) -> None:
    if response.status_code == 200:
        tally.add("served", kind)
        return
    what, expected = error_kind(response)
    tally.add("expected" if expected else "errors", f"{kind}: {what}")


def stream(http: httpx.Client, kind: str, max_tokens: int, rng: random.Random, tally: Tally) -> None:
    hang_up_at = rng.randint(1, max_tokens) if kind == "stream-hangup" else None
    body = {"model": MODEL_NAME, "prompt": "The little dog", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            record(response, kind, tally)
            return
        chunks = 0
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                what, expected = error_kind(None, event)
                tally.add("expected" if expected else "errors", f"{kind}: {what}")
                return
            chunks += 1
            if hang_up_at is not None and chunks >= hang_up_at:
                break  # leaving the block closes the connection mid-stream
    tally.add("served", kind)


def control_loop(admin: httpx.Client, model: str, upload: bytes, rng: random.Random, deadline: float,
                 tally: Tally) -> None:
    actions = {
        "sleep+wake": lambda: (admin.post("/sleep", json={"level": 1}), time.sleep(rng.random()),
                               admin.post("/wake_up", json={}))[-1],
        "pause+resume": lambda: (admin.post("/pause", json={"mode": "keep"}), time.sleep(rng.random()),
                                 admin.post("/resume"))[-1],
        "update_from_disk": lambda: admin.post("/update_weights_from_disk", json={"model_path": model}),
        "update_from_tensor": lambda: admin.post("/update_weights_from_tensor", content=upload,
                                                 headers={"Content-Type": "application/octet-stream"}),
        "reset_prefix_cache": lambda: admin.post("/reset_prefix_cache"),
    }
    while time.monotonic() < deadline:
        time.sleep(1 + rng.random() * 3)
        name = rng.choice(sorted(actions))
        response = actions[name]()
        tally.add("actions", f"{name}: {response.status_code}")


def start_server(model: str, threads: int) -> tuple[subprocess.Popen, str, str]:
    port, admin_port = free_port(), free_port()
    log = open(os.path.join(tempfile.gettempdir(), f"trillium-soak-{port}.log"), "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "trillium.cli", "serve", "--model", model, "--host", "127.0.0.1",
         "--port", str(port), "--admin-host", "127.0.0.1", "--admin-port", str(admin_port),
         "--served-model-name", MODEL_NAME, "--kv-cache-memory", "16MiB", "--executor-threads", str(threads),
         "--engine-stall-timeout-s", "30"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TRILLIUM_ADMIN_TOKEN": TOKEN})
    base, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"trillium serve exited {process.returncode}; see {log.name}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return process, base, admin
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"trillium serve did not become healthy; see {log.name}")


def leaked_blocks(admin: httpx.Client) -> int:
    """Device blocks held once no request runs (after the prefix cache is reset)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = admin.get("/server_info").json()["engine_info"]
        if info["num_running"] == 0 and info["num_waiting"] == 0:
            break
        time.sleep(0.2)
    admin.post("/reset_prefix_cache")
    time.sleep(0.5)  # WHY: the scheduler reports its state in the stats that follow the reset
    info = admin.get("/server_info").json()["engine_info"]
    return info["num_blocks"] - info["num_free_blocks"]


def norm_upload(model: str) -> bytes:
    from safetensors.torch import load_file, save

    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            tensors = load_file(os.path.join(model, name))
            if "model.norm.weight" in tensors:
                return save({"model.norm.weight": tensors["model.norm.weight"]})
    raise SystemExit(f"{model}: no model.norm.weight in its safetensors files")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="how long the load runs")
    parser.add_argument("--clients", type=int, default=8, help="client threads")
    parser.add_argument("--seed", type=int, default=0, help="seeds every random choice")
    parser.add_argument("--model", default=None, help="HF model directory (default: a synthetic llama)")
    parser.add_argument("--executor-threads", type=int, default=1)
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from trillium.models.synthetic import build_checkpoint

        model = str(build_checkpoint(tempfile.mkdtemp(prefix="trillium-soak-model-"), "llama",
                                     max_position_embeddings=4096))
    process, base, admin_url = start_server(os.path.realpath(model), args.executor_threads)
    tally = Tally()
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.minutes * 60
    started = time.monotonic()
    try:
        with httpx.Client(base_url=admin_url, timeout=300, headers={"Authorization": f"Bearer {TOKEN}"}) as admin:
            threads = [threading.Thread(target=client_loop, args=(base, random.Random(rng.random()), deadline, tally))
                       for _ in range(args.clients)]
            threads.append(threading.Thread(target=control_loop, args=(
                admin, os.path.realpath(model), norm_upload(model), random.Random(rng.random()), deadline, tally)))
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            leaked = leaked_blocks(admin)
            healthy = httpx.get(base + "/health", timeout=10).status_code == 200
    finally:
        process.terminate()
        exit_code = process.wait(timeout=60)
    elapsed = time.monotonic() - started
    print(f"soak: {elapsed:.0f} s, {args.clients} clients, seed {args.seed}, model {model}")
    print(f"requests served: {sum(tally.served.values())}  {dict(sorted(tally.served.items()))}")
    print(f"expected 503s (asleep / paused / updating): {sum(tally.expected.values())}  "
          f"{dict(sorted(tally.expected.items()))}")
    print(f"errors by kind: {sum(tally.errors.values())}  {dict(sorted(tally.errors.items()))}")
    print(f"control actions: {dict(sorted(tally.actions.items()))}")
    print(f"KV blocks leaked: {leaked}")
    print(f"healthy at the end: {healthy}; server exit code after SIGTERM: {exit_code}")
    return 0 if leaked == 0 and not tally.errors and healthy and exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
