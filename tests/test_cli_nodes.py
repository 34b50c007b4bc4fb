"""More than one host, without starting anything: the flags' refusals, the secret file, the
placement of ranks, and the ranks' membership proof over an in-memory group.

Flags as vLLM's serve parser declares them (vllm-project/vllm, vllm/engine/arg_utils.py
`--nnodes -n`, `--node-rank -r`, `--master-addr`, `--master-port`; vllm/entrypoints/cli/
serve.py `--headless`); vLLM's multi-node data-parallel flags (`--data-parallel-size-local`,
`--data-parallel-address`, `--data-parallel-rpc-port`, `--data-parallel-start-rank`, same
arg_utils.py) in the combinations not built are refused by name. The two-process runs are
tests/e2e/test_serve_multi_node.py and tests/e2e/test_serve_dp_remote.py.
"""

from __future__ import annotations

import os
import threading

import attrs
import pytest

from trillium.actors.assembly import ActorConfig, Addresses, engine_specs
from trillium.actors.link_auth import LinkKey
from trillium.cli import main
from trillium.config import EngineConfig
from trillium.distributed.nodes import (MembershipError, config_fingerprint, prove_membership, ranks_on_node,
                                        read_link_secret)


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("flags, named", [
    (["-tp", "2", "--nnodes", "2"], "--link-secret-file"),
    (["-tp", "3", "--nnodes", "2", "--link-secret-file", "S"], "--nnodes 2"),
    (["-tp", "2", "--nnodes", "2", "--node-rank", "2", "--link-secret-file", "S"], "--node-rank 2"),
    (["-tp", "2", "--nnodes", "2", "--node-rank", "1", "--link-secret-file", "S"], "--headless"),
    (["-tp", "2", "--nnodes", "2", "--headless", "--link-secret-file", "S"], "--headless"),
    (["-dp", "2", "--nnodes", "2", "-tp", "2", "--link-secret-file", "S"], "--data-parallel-size 2"),
    (["-dp", "2", "--data-parallel-size-local", "3"], "--data-parallel-size-local 3"),
    (["--data-parallel-address", "10.0.0.1"], "--data-parallel-address"),
    (["--data-parallel-rpc-port", "13345"], "--data-parallel-rpc-port"),
    (["--data-parallel-start-rank", "1"], "--data-parallel-start-rank 1"),
    (["-dp", "2", "-dpl", "1", "--link-secret-file", "S"], "--data-parallel-address"),
    (["-dp", "2", "-dpl", "1", "-dpa", "127.0.0.1", "-dpp", "13345"], "--link-secret-file"),
    (["-dp", "2", "-dpl", "1", "-dpa", "127.0.0.1", "-dpp", "13345", "--link-secret-file", "S", "-tp", "2"],
     "--tensor-parallel-size 2"),
    (["-dp", "2", "-dpl", "1", "--headless", "-dpa", "127.0.0.1", "-dpp", "13345", "--link-secret-file", "S"],
     "--data-parallel-start-rank"),
    (["-dp", "2", "-dpr", "0", "--headless", "-dpa", "127.0.0.1", "-dpp", "13345", "--link-secret-file", "S"],
     "--data-parallel-start-rank 0"),
    (["-dp", "2", "-dpr", "1", "--headless", "-dpa", "127.0.0.1", "-dpp", "13345", "--link-secret-file", "S",
      "--nnodes", "2", "-tp", "2"], "--nnodes 2"),
])
def test_combinations_not_built_are_start_up_errors_naming_the_flag(flags, named, secret_file):
    flags = [str(secret_file) if f == "S" else f for f in flags]
    with pytest.raises(SystemExit) as exc:
        main(["serve", "/nonexistent-model", *flags])
    assert named in str(exc.value)


def test_the_secret_file_must_be_private_and_hold_32_bytes(tmp_path, secret_file):
    assert read_link_secret(str(secret_file)) == secret_file.read_text().strip()
    secret_file.chmod(0o640)
    with pytest.raises(ValueError, match="chmod 600"):
        read_link_secret(str(secret_file))
    short = tmp_path / "short"
    short.write_text("abcd")
    short.chmod(0o600)
    with pytest.raises(ValueError, match="64 hex digits"):
        read_link_secret(str(short))
    with pytest.raises(ValueError, match="cannot read"):
        read_link_secret(str(tmp_path / "missing"))


def test_each_node_runs_its_own_ranks():
    engine = EngineConfig(model="/m", tensor_parallel_size=4, tp_nnodes=2, tp_master_port=29501)
    config = ActorConfig(engine, Addresses.inproc())
    head = [spec.name for spec in engine_specs(config, 0)]
    assert head == ["executor", "executor-rank1", "detokenizer", "scheduler"]
    node1 = engine_specs(config, 1)
    assert [spec.name for spec in node1] == ["executor-rank2", "executor-rank3"]
    assert [ActorConfig.from_bytes(spec.config).tp_rank for spec in node1] == [2, 3]
    assert list(ranks_on_node(4, 2, 1)) == [2, 3]


class _MemoryGroup:
    """TpGroup's two byte collectives over shared memory, one thread per rank."""

    def __init__(self, rank: int, size: int, shared: dict) -> None:
        self.rank, self.size, self.is_first, self._shared = rank, size, rank == 0, shared

    def broadcast_bytes(self, payload):
        if self.is_first:
            self._shared["broadcast"] = payload
        self._shared["barrier"].wait()
        return self._shared["broadcast"]

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        self._shared[self.rank] = data
        self._shared["barrier"].wait()
        return [self._shared[rank] for rank in range(self.size)]


def _prove(keys: list[LinkKey], prints: list[bytes]) -> list[BaseException | None]:
    shared = {"barrier": threading.Barrier(len(keys), timeout=10)}
    outcome: list[BaseException | None] = [None] * len(keys)

    def rank(r: int) -> None:
        try:
            prove_membership(_MemoryGroup(r, len(keys), shared), keys[r], prints[r])
        except MembershipError as exc:
            outcome[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(keys))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    return outcome


def test_every_rank_refuses_a_rank_without_the_secret_or_with_another_config():
    key, stranger = LinkKey.generate(), LinkKey.generate()
    engine = EngineConfig(model="/m", tensor_parallel_size=2, tp_nnodes=2)
    same = config_fingerprint(engine)
    # A host's own model path, device and threads do not count; the KV cache's size does.
    assert config_fingerprint(attrs.evolve(engine, model="/other/path", device="cpu", num_threads=3)) == same
    other = config_fingerprint(attrs.evolve(engine, num_blocks=engine.num_blocks + 1))
    assert other != same
    assert _prove([key, key], [same, same]) == [None, None]
    assert all("did not prove the deployment secret" in str(e) and "[1]" in str(e)
               for e in _prove([key, stranger], [same, same])[:1])
    assert all(e is not None for e in _prove([key, stranger], [same, same]))
    wrong_config = _prove([key, key], [same, other])
    assert all("another engine config" in str(e) for e in wrong_config)
