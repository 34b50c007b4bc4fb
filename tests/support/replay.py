"""Harness of tests/compat: replay an RL framework's HTTP calls against a live `trillium serve`.

- `weights_root(tmp)`: two synthetic llama checkpoints under one root, "base" (served; seed 0)
  and "next" (seed 1: other greedy outputs), so a test can push "next" and see it served.
- `start_server(root, *flags, env)`: `trillium serve` on "base" with that root allowed for
  disk updates, small KV pool; the framework's deployment flags come from the test module.
- `Replay`: an httpx client on one base URL that makes one call at a time, asserts the status
  and says which call of the framework's cycle failed (method, path, query, status, body).
- `GroupTrainer`: the SGLang-style weight push as slime / AReaL make it: the framework's
  `/init_weights_update_group` and `/update_weights_from_distributed` POSTs (bodies, and the
  paths where a framework names them otherwise, from the test), while tests/support/group_broadcaster.py, a separate trainer process, joins the
  group with SGLang's custom-group recipe and broadcasts the tensors.
- `hf_greedy_ids(path, prompt, n)` and `oracle_greedy(replay, prompt, n)`: transformers' and
  the server's greedy tokens (EOS held off), the check that a push changed the served weights.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import subprocess
import sys
from pathlib import Path

import httpx

from support.oracles import hf_greedy, transformers_model
from support.serve_process import ServeProcess
from trillium.models.synthetic import build_checkpoint

BROADCASTER = Path(__file__).with_name("group_broadcaster.py")
# WHY this long: on the shared 2-core machine a start (imports, three engine processes) has taken
# over 120 s under load; a healthy server is used as soon as it answers.
START_TIMEOUT_S = 300


def weights_root(root: Path) -> Path:
    build_checkpoint(root / "base", "llama", seed=0)
    build_checkpoint(root / "next", "llama", seed=1)
    return root


def start_server(root: Path, *flags: str, env: dict | None = None) -> ServeProcess:
    return ServeProcess(
        str(root / "base"), "--allowed-weight-paths", str(root), "--kv-cache-memory", "16MiB",
        "--max-num-seqs", "16", *flags, env=env,
    ).wait_healthy(timeout_s=START_TIMEOUT_S)


def tensor_specs(checkpoint: Path) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtypes as SGLang spells them, shapes) of a checkpoint's tensors, in file order."""
    from safetensors import safe_open

    names, dtypes, shapes = [], [], []
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            tensor = f.get_slice(name)
            names.append(name)
            dtypes.append({"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[tensor.get_dtype()])
            shapes.append(list(tensor.get_shape()))
    return names, dtypes, shapes


def hf_greedy_ids(checkpoint: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    return list(_hf_greedy_ids(str(checkpoint), tuple(prompt_ids), max_new_tokens))


@functools.cache
def _hf_greedy_ids(checkpoint: str, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    tokens, _ = hf_greedy(transformers_model(Path(checkpoint)), list(prompt_ids), max_new_tokens, top_n=1)
    return tuple(tokens)


class Replay:
    """One framework's client: calls in order, each checked for its status."""

    def __init__(self, base_url: str, framework: str, headers: dict | None = None) -> None:
        self.framework = framework
        self.http = httpx.Client(base_url=base_url, headers=headers or {}, timeout=180)
        self.calls: list[str] = []

    def call(self, method: str, path: str, *, expect: int | tuple[int, ...] = 200, **kwargs) -> httpx.Response:
        response = self.http.request(method, path, **kwargs)
        shown = f"{method} {path}" + (f"?{httpx.QueryParams(kwargs['params'])}" if kwargs.get("params") else "")
        self.calls.append(f"{shown} -> {response.status_code}")
        wanted = (expect,) if isinstance(expect, int) else expect
        assert response.status_code in wanted, (
            f"{self.framework} call #{len(self.calls)} {shown} answered {response.status_code} "
            f"(the framework needs {wanted}): {response.text[:600]}\ncalls so far: {self.calls}"
        )
        return response

    def json(self, method: str, path: str, **kwargs):
        return self.call(method, path, **kwargs).json()

    def close(self) -> None:
        self.http.close()


class GroupTrainer:
    """The trainer side of an SGLang-style group: the framework's init POST, then pushes.

    `join(init_body)` POSTs the framework's `/init_weights_update_group` body and starts
    tests/support/group_broadcaster.py, which joins with SGLang's custom-group recipe
    (WHY a thread: the engine answers the init only once the trainer has joined, as SGLang
    does). `push(update_body)` POSTs `/update_weights_from_distributed` while that process
    broadcasts the checkpoint's tensors in the body's name order; it ends with the push."""

    def __init__(self, replay: Replay, checkpoint: Path, tmp: Path, timeout_s: float = 60) -> None:
        self.replay, self.checkpoint, self.tmp, self.timeout_s = replay, checkpoint, tmp, timeout_s
        self.names, self.dtypes, self.shapes = tensor_specs(checkpoint)
        self.process: subprocess.Popen | None = None

    def join(self, init_body: dict, path: str = "/init_weights_update_group") -> dict:
        names_path = self.tmp / "names.json"
        names_path.write_text(json.dumps(self.names))
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            init = pool.submit(self.replay.json, "POST", path, json=init_body)
            self.process = subprocess.Popen(
                [sys.executable, str(BROADCASTER), str(int(init_body["master_port"])), init_body["group_name"],
                 str(init_body["world_size"]), str(self.checkpoint), str(names_path), str(self.timeout_s)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                return init.result(timeout=self.timeout_s + 60)
            except BaseException:
                self.kill()
                raise

    def push(self, update_body: dict, path: str = "/update_weights_from_distributed") -> dict:
        assert self.process is not None, "join() first"
        try:
            reply = self.replay.json("POST", path, json=update_body)
            out, _ = self.process.communicate(timeout=self.timeout_s)
        finally:
            self.kill()
        assert self.process.returncode == 0 and "done" in out, out[-3000:]
        return reply

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def oracle_greedy(replay: Replay, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from /generate with EOS held off (as hf_greedy): the oracle check, not a framework call."""
    body = {"input_ids": prompt_ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens}}
    return replay.json("POST", "/generate", json=body)["output_ids"]
