"""Scaling out: mixed-workload HTTP throughput of one engine vs data-parallel replicas, side by side.

Run: .venv/bin/python bench/scale.py [--model PATH] [--num-prompts 64] [--rounds 3]

Starts one `trillium serve` per configuration (CONFIGS: DP=1, and
--data-parallel-size 2), all on the same model and KV size, then drives
them with `trillium bench serving`'s client and mixed workload (prompts
U[32, 512], outputs U[16, 256], greedy, ignore_eos, all sent at once;
trillium/benchmarks/compare.py): each round sends the same fresh prompts
to every server in turn, so a shared machine's drift hits all alike, and a
row is the server's median round. Without --model it builds the `bench`
checkpoint (trillium build-model --variant bench) in a temporary directory.

NOTE: on a small CPU machine the replicas split the same cores (each
executor gets cores / N threads), so DP cannot win there: the table is the
record of what the routing and the second engine cost. On a machine with N
devices each replica has its own (cuda:i). The machine may be shared with
other work; its numbers are for comparison inside one run only.

CONFIGS is the one place to add rows (tensor parallelism's
--tensor-parallel-size, when it exists, is another row of flags).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

# (row label, extra `trillium serve` flags)
CONFIGS = (
    ("DP=1", ()),
    ("DP=2", ("--data-parallel-size", "2")),
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: str, flags, kv: str, log_dir: str, label: str):
    port, admin_port = _free_port(), _free_port()
    log = open(os.path.join(log_dir, f"serve-{label.replace('=', '')}.log"), "wb")
    cmd = [sys.executable, "-m", "trillium.cli", "serve", "--model", model, "--port", str(port),
           "--admin-port", str(admin_port), "--kv-cache-memory", kv, "--max-num-seqs", "64", *flags]
    env = {**os.environ, "TRILLIUM_ADMIN_TOKEN": "bench-scale"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), f"http://127.0.0.1:{port}", log


def _wait_healthy(process, url: str, log_path: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"trillium serve exited {process.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"trillium serve at {url} not healthy after {timeout_s:.0f} s; see {log_path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bench model, built)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default="256MiB", help="per replica")
    args = parser.parse_args(argv)
    # WHY: SIGTERM (a timeout, a CI cancel) must still stop the servers this script started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from trillium.benchmarks import compare
    from trillium.models.loader import load_model_config

    work = tempfile.mkdtemp(prefix="trillium-bench-scale-")
    model = args.model
    if model is None:
        from trillium.models.synthetic import build_checkpoint

        model = str(build_checkpoint(os.path.join(work, "bench"), "bench"))
    servers = []
    try:
        for label, flags in CONFIGS:
            servers.append((label, *_start(model, flags, args.kv_cache_memory, work, label)))
        for label, process, url, log in servers:
            _wait_healthy(process, url, log.name)
        print(f"model {model}; {os.cpu_count()} CPUs (shared machine: compare rows of this run only); "
              f"logs in {work}", flush=True)
        labels = [f"--label={label.replace('=', '')}={url}" for label, _, url, _ in servers]
        vocab = load_model_config(model).vocab_size
        return compare.main([*labels, "--num-prompts", str(args.num_prompts), "--rounds", str(args.rounds),
                             "--vocab-size", str(vocab)])
    finally:
        for _, process, _, log in servers:
            process.terminate()
        for _, process, _, log in servers:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
            log.close()


if __name__ == "__main__":
    raise SystemExit(main())
