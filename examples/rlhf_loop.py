"""An RLHF-style loop against a live `trillium serve`: train, push weights, check, repeat.

    python examples/rlhf_loop.py --steps 3

What it does:

1. Builds a small deterministic checkpoint (`trillium build-model` llama
   variant) unless --model names one, and starts `trillium serve` on it
   (or uses a running server: --url, --admin-url and TRILLIUM_ADMIN_TOKEN).
2. Loads the same checkpoint in `transformers` as the trainer's policy and
   forms the weight-update group with the server (`trillium.rlhf.WeightSync`:
   this process is rank 0, gloo on CPU).
3. A client thread keeps sending sampled completions the whole time, as
   rollout workers would; requests that arrive while weights are swapped
   get 503 + Retry-After and are retried.
4. Each step: one SGD step on a few lines of text, `sync.push(...)` of every
   parameter over torch.distributed with version "step-<n>", then greedy
   completions from the server are compared with `transformers` greedy
   decoding on the trainer's current weights. Exit code 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import torch

EVAL_PROMPTS = ["Once upon a time", "The baker named Tom", "Children walked to school"]
MAX_NEW_TOKENS = 12


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post_json(url: str, body: dict, timeout_s: float = 120) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def start_server(model: str, workdir: str, token: str) -> tuple[subprocess.Popen, str, str]:
    port, admin_port = free_port(), free_port()
    log = open(os.path.join(workdir, "serve.log"), "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "trillium.cli", "serve", "--model", model, "--port", str(port),
         "--admin-port", str(admin_port), "--kv-cache-memory", "64MiB", "--served-model-name", "policy"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TRILLIUM_ADMIN_TOKEN": token},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"trillium serve exited with {process.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return process, url, f"http://127.0.0.1:{admin_port}"
        except OSError:
            time.sleep(0.2)
    process.terminate()
    raise SystemExit("trillium serve did not become healthy in 180 s")


class Traffic(threading.Thread):
    """Sampled completions in a loop, as rollout workers send them during training."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.num_ok = self.num_refused = 0
        self.errors: list[str] = []
        self.versions: set[str] = set()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            status, body = post_json(self.url + "/v1/completions", {
                "model": "policy", "prompt": EVAL_PROMPTS[i % len(EVAL_PROMPTS)], "max_tokens": 16,
                "temperature": 0.8, "seed": i})
            if status == 200:
                self.num_ok += 1
                self.versions.add(body["weight_version"])
            elif status == 503:  # a weight swap in progress: back off and retry
                self.num_refused += 1
                time.sleep(0.05)
            else:
                self.errors.append(f"{status}: {body}")


def training_batch(tokenizer) -> dict:
    from trillium.models.synthetic_corpus import CORPUS

    lines = [line for line in CORPUS.splitlines() if line.strip()][:4]
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    return {**batch, "labels": labels}


@torch.inference_mode()
def check_outputs(policy, tokenizer, url: str) -> tuple[bool, list[str]]:
    """Server greedy text == transformers greedy text on the trainer's weights, per prompt."""
    ok, texts = True, []
    for prompt in EVAL_PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        out = policy.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0)
        expected = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        status, body = post_json(url + "/v1/completions", {
            "model": "policy", "prompt": ids, "max_tokens": MAX_NEW_TOKENS, "temperature": 0})
        got = body["choices"][0]["text"] if status == 200 else f"<HTTP {status}: {body}>"
        if got != expected:
            ok = False
            print(f"    MISMATCH {prompt!r}: server {got!r} vs transformers {expected!r}")
        texts.append(got)
    return ok, texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.5, help="SGD learning rate (large: outputs visibly move)")
    parser.add_argument("--model", default=None, help="HF checkpoint directory (default: a synthetic one)")
    parser.add_argument("--url", default=None, help="data plane of a running server (default: start one)")
    parser.add_argument("--admin-url", default=None, help="its admin API (with --url; token from TRILLIUM_ADMIN_TOKEN)")
    parser.add_argument("--bucket-mib", type=int, default=1024, help="largest push bucket")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trillium.models.synthetic import build_checkpoint
    from trillium.rlhf import WeightSync

    torch.manual_seed(0)
    workdir = tempfile.mkdtemp(prefix="trillium-rlhf-")
    model = args.model or str(build_checkpoint(os.path.join(workdir, "policy"), "llama", seed=0))
    server = None
    if args.url:
        url, admin_url, token = args.url, args.admin_url, os.environ["TRILLIUM_ADMIN_TOKEN"]
    else:
        token = secrets.token_urlsafe(24)
        print(f"starting trillium serve on {model} ...")
        server, url, admin_url = start_server(model, workdir, token)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    optimizer = torch.optim.SGD(policy.parameters(), lr=args.lr)
    batch = training_batch(tokenizer)
    traffic = Traffic(url)
    all_ok = True
    try:
        with WeightSync(admin_url, token) as sync:
            sync.init_group(master_address="127.0.0.1", backend="gloo")
            traffic.start()
            policy.eval()
            ok, previous = check_outputs(policy, tokenizer, url)
            print(f"step 0: outputs match transformers: {ok}")
            all_ok &= ok
            for step in range(1, args.steps + 1):
                policy.train()
                loss = policy(**batch).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                policy.eval()
                started_s = time.monotonic()
                version = sync.push(policy.named_parameters(), version=f"step-{step}",
                                    bucket_bytes=args.bucket_mib << 20)
                push_s = time.monotonic() - started_s
                ok, texts = check_outputs(policy, tokenizer, url)
                all_ok &= ok
                changed = sum(a != b for a, b in zip(texts, previous))
                previous = texts
                print(f"step {step}: loss {loss.item():.3f}, pushed version {version} in {push_s:.2f} s, "
                      f"outputs match transformers: {ok} ({changed}/{len(texts)} prompts changed)")
    finally:
        traffic.stop.set()
        if traffic.is_alive():
            traffic.join(30)
        if server is not None:
            server.terminate()
            server.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"client traffic: {traffic.num_ok} completions, {traffic.num_refused} refused during swaps (503), "
          f"{len(traffic.errors)} errors; versions seen: {sorted(traffic.versions)}")
    for error in traffic.errors[:5]:
        print("  error:", error)
    return 0 if all_ok and not traffic.errors else 1


if __name__ == "__main__":
    sys.exit(main())
