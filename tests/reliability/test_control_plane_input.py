"""Control-plane input a trainer or an operator can get wrong, against a real `trillium serve`.

- `update_weights_from_distributed` is checked before any allocation: a
  dimension past int64 (`[[2**64]]`, a 500 before) and one past 2**31 are
  400s at the API; an unknown name or a shape the model lacks, and a total
  size beyond the model's, are 400s from the engine *before it receives*
  (the silent trainer below never broadcasts: a check after the transfer
  would have waited for its timeout), and the group is closed (the reply
  says so, /server_info too). SGLang's engine allocates
  `torch.empty(shape, dtype)` for each announced tensor before the
  broadcast (sgl-project/sglang python/sglang/srt/model_executor/model_runner.py
  `update_weights_from_distributed`); Trillium checks first.
- A weight directory under the allowed root whose file is a symlink out of
  it is a 403 naming the file (paths.py `escaping_links`).
- `--admin-token-file` sets the token (the environment's is then refused);
  the engine's child processes inherit neither the admin token nor the API
  key (their /proc/<pid>/environ); `--admin-token` on the command line logs a
  warning; a generated token is printed once on stderr and logged only as
  its SHA-256 fingerprint.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from support.admin_server import ADMIN_TOKEN, AdminServer, free_port, serve_command
from support.engine_faults import engine_pids
from trillium.control_plane.paths import WeightPathPolicy

FILE_TOKEN = "token-from-a-file-0123456789"

SILENT_TRAINER = textwrap.dedent(
    """
    import sys
    from trillium.distributed.update_group import close_group, open_group
    print("ready", flush=True)
    group = open_group("127.0.0.1", int(sys.argv[1]), rank=0, world_size=2, timeout_s=60)
    print("joined", flush=True)
    sys.stdin.read()  # never broadcasts; until the test closes our stdin
    close_group(group)
    """
)


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory, checkpoint):
    """An allowed root holding `linked/`: the checkpoint's files, its weights a symlink out of the root."""
    source = checkpoint("llama")
    root = tmp_path_factory.mktemp("allowed-weights")
    linked = root / "linked"
    linked.mkdir()
    for entry in source.iterdir():
        if entry.suffix == ".safetensors":
            os.symlink(entry, linked / entry.name)
        else:
            shutil.copy(entry, linked / entry.name)
    return root


@pytest.fixture(scope="module")
def server_tmp(tmp_path_factory):
    """The server's TMPDIR: its socket directory and uploads land here."""
    return tmp_path_factory.mktemp("server-tmp")


@pytest.fixture(scope="module")
def server(checkpoint, weights_root, tmp_path_factory, server_tmp):
    token_file = tmp_path_factory.mktemp("secrets") / "admin-token"
    token_file.write_text(FILE_TOKEN + "\n")
    proc = AdminServer(str(checkpoint("llama")), "--admin-token-file", str(token_file),
                       "--allowed-weight-paths", str(weights_root), "--executor-threads", "1",
                       "--kv-cache-memory", "4MiB", env={"TRILLIUM_API_KEY": "sk-env-key", "TMPDIR": str(server_tmp)},
                       admin_token=FILE_TOKEN)
    try:
        proc.wait_ready()
    except BaseException:
        proc.stop()
        raise
    yield proc
    assert proc.stop() == 0, proc.log()


def distributed(server, names, shapes, dtypes=None):
    body = {"names": names, "dtypes": dtypes or ["float32"] * len(names), "shapes": shapes}
    return server.admin("POST", "/update_weights_from_distributed", json=body, timeout=120)


def open_group_with_silent_trainer(server, tmp_path) -> subprocess.Popen:
    script = tmp_path / "silent_trainer.py"
    script.write_text(SILENT_TRAINER)
    port = free_port()
    trainer = subprocess.Popen([sys.executable, str(script), str(port)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert trainer.stdout.readline().strip() == b"ready"
    init = server.admin("POST", "/init_weights_update_group", timeout=120,
                        json={"master_address": "127.0.0.1", "master_port": port, "timeout_s": 60})
    assert init.status_code == 200, init.text
    assert trainer.stdout.readline().strip() == b"joined"
    return trainer


def release(trainer: subprocess.Popen) -> None:
    trainer.stdin.close()
    assert trainer.wait(timeout=60) == 0


def test_absurd_dimensions_are_400_at_the_api(server):
    for dim in (2**64, 2**40):
        response = distributed(server, ["model.norm.weight"], [[dim]])
        assert response.status_code == 400, response.text
        assert "shapes" in response.text
    response = distributed(server, ["model.norm.weight"], [[1] * 9])
    assert response.status_code == 400, response.text


@pytest.mark.parametrize(("names", "shapes", "says"), [
    (["model.not_a_weight"], [[4]], "unknown weight"),
    pytest.param(["model.norm.weight"], [[65]], "bad weight", marks=pytest.mark.heavy),
    pytest.param(["model.embed_tokens.weight"], [[2**30, 2**30]], "announces", marks=pytest.mark.heavy),
])
def test_wrong_announcement_is_400_before_receiving(server, tmp_path, names, shapes, says):
    trainer = open_group_with_silent_trainer(server, tmp_path)
    try:
        started = time.monotonic()
        response = distributed(server, names, shapes)
        elapsed_s = time.monotonic() - started
    finally:
        release(trainer)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert says in message and "nothing was received" in message, message
    # WHY: a check after the transfer would have waited the group's 60 s receive timeout.
    assert elapsed_s < 50
    assert server.admin_ok("GET", "/server_info")["engine_info"]["weights_update_group"] is None
    assert server.complete("Once upon a time", 4).status_code == 200


def test_weight_file_linked_out_of_the_root_is_403(server, weights_root):
    response = server.admin("POST", "/update_weights_from_disk", json={"model_path": str(weights_root / "linked")})
    assert response.status_code == 403, response.text
    assert "model.safetensors" in response.json()["error"]["message"]


def test_uploads_are_streamed_to_a_temp_file_that_is_removed(server, server_tmp, checkpoint):
    from safetensors.torch import load_file, save

    norm = load_file(str(checkpoint("llama") / "model.safetensors"))["model.norm.weight"]
    ok = server.admin("POST", "/update_weights_from_tensor?weight_version=uploaded", content=save(
        {"model.norm.weight": norm}), headers={"Content-Type": "application/octet-stream"}, timeout=120)
    assert ok.status_code == 200, ok.text
    bad = server.admin("POST", "/update_weights_from_tensor", content=b"\x10" + b"\0" * 7 + b"not a header",
                       headers={"Content-Type": "application/octet-stream"})
    assert bad.status_code == 400, bad.text
    wrong = server.admin("POST", "/update_weights_from_tensor", content=save({"model.norm.weight": norm[:3]}),
                         headers={"Content-Type": "application/octet-stream"}, timeout=120)
    assert wrong.status_code == 400, wrong.text
    assert not [p.name for p in server_tmp.iterdir() if p.name.startswith("trillium-upload-")]
    assert server.admin_ok("GET", "/weight_version") == {"weight_version": "uploaded"}


def test_escaping_links_policy(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_text("x")
    (root / "inside").write_text("y")
    os.symlink(root / "inside", root / "ok-link")
    os.symlink(outside / "secret", root / "sub" / "file-link")
    os.symlink(outside, root / "dir-link")
    policy = WeightPathPolicy((str(root),))
    assert policy.escaping_links(str(root)) == ["dir-link", os.path.join("sub", "file-link")]
    assert policy.escaping_links(str(root / "inside")) == []


def test_token_file_and_no_secrets_in_children(server):
    assert server.admin("GET", "/health").status_code == 200
    assert server.admin("GET", "/health", token=ADMIN_TOKEN).status_code == 401  # the environment's
    assert FILE_TOKEN not in server.log()
    for actor, pid in engine_pids(server).items():
        with open(f"/proc/{pid}/environ", "rb") as f:
            names = {item.split(b"=", 1)[0] for item in f.read().split(b"\0") if item}
        assert not names & {b"TRILLIUM_ADMIN_TOKEN", b"TRILLIUM_API_KEY"}, actor


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(serve_command(*args), capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_generated_token_printed_once_and_logged_as_fingerprint(tmp_path):
    # A folder that holds no checkpoint: the start fails right after the token is resolved.
    (tmp_path / "no-model").mkdir()
    run = run_cli(str(tmp_path / "no-model"), "--admin-port", str(free_port()),
                  env={"TRILLIUM_ADMIN_TOKEN": ""})
    printed = re.findall(r"admin API token \(generated for this run\): (\S+)", run.stderr)
    assert len(printed) == 1, run.stderr[-2000:]
    token = printed[0]
    assert (run.stdout + run.stderr).count(token) == 1
    assert f"fingerprint {hashlib.sha256(token.encode()).hexdigest()[:16]}" in run.stderr


def test_admin_token_flags(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-file")
    both = run_cli(str(tmp_path), "--admin-token", "x", "--admin-token-file", str(token_file))
    assert both.returncode == 2 and "not both" in both.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert run_cli(str(tmp_path), "--admin-token-file", str(empty)).returncode == 2
    # On the command line: a warning, then (non-loopback admin host with the API key as token) refused.
    visible = run_cli(str(tmp_path), "--admin-token", "same", "--api-key", "same", "--admin-host", "0.0.0.0")
    assert visible.returncode == 2
    assert "visible to every local user" in visible.stderr
