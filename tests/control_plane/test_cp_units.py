"""Pure pieces of the control plane and the trainer client: no server, no engine.

Admin token resolution (generate on loopback, refuse elsewhere, never the
API key), the weight-path policy (symlinks and `..` resolved, sibling
prefixes refused), EngineStatus (closing commands, settled replies, newer
stats win), body validation, safetensors checking, bucket splitting.
"""

from __future__ import annotations

import os

import attrs
import pytest
import torch
from safetensors.torch import save

from trillium.actors.protocol.outputs import SchedulerStats
from trillium.control_plane.auth import (
    AdminConfigError,
    check_bearer,
    is_loopback_host,
    resolve_admin_token,
)
from trillium.control_plane.errors import AdminError
from trillium.control_plane.paths import (
    WeightPathPolicy,
    default_roots,
    split_path_list,
)
from trillium.control_plane.protocol import (
    InitGroupRequest,
    SleepRequest,
    UpdateFromDistributedRequest,
    parse_body,
    parse_bool,
)
from trillium.control_plane.routes.weights import check_safetensors
from trillium.control_plane.status import EngineStatus
from trillium.rlhf.weight_sync import _buckets


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("example.com", False),
])
def test_cp_loopback_hosts(host, loopback):
    assert is_loopback_host(host) is loopback


def test_cp_token_resolution():
    token, generated = resolve_admin_token("127.0.0.1", None)
    assert generated and len(token) >= 32
    assert resolve_admin_token("127.0.0.1", None)[0] != token  # random each start
    assert resolve_admin_token("0.0.0.0", " secret ") == ("secret", False)
    with pytest.raises(AdminConfigError, match="non-loopback"):
        resolve_admin_token("0.0.0.0", None)
    with pytest.raises(AdminConfigError, match="non-loopback"):
        resolve_admin_token("10.1.2.3", "  ")
    with pytest.raises(AdminConfigError, match="differ"):
        resolve_admin_token("127.0.0.1", "same", api_key="same")


def test_cp_bearer_check():
    assert check_bearer("Bearer tok", "tok")
    assert check_bearer("bearer  tok ", "tok")
    for header in (None, "", "tok", "Basic tok", "Bearer tok2", "Bearer to", "Bearer"):
        assert not check_bearer(header, "tok")


def test_cp_weight_paths(tmp_path):
    root = tmp_path / "weights"
    (root / "ckpt").mkdir(parents=True)
    (tmp_path / "weights-evil").mkdir()
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", root / "link")
    policy = WeightPathPolicy((str(root),))
    assert policy.is_allowed(str(root / "ckpt"))
    assert policy.is_allowed(str(root))
    assert not policy.is_allowed(str(root / "ckpt" / ".." / ".." / "secret"))
    assert not policy.is_allowed(str(root / "link"))  # the link leads outside
    assert not policy.is_allowed(str(tmp_path / "weights-evil"))  # a sibling sharing the prefix
    assert not WeightPathPolicy(()).is_allowed(str(root / "ckpt"))
    assert split_path_list(["a,b", " c ", ""]) == ("a", "b", "c")
    assert default_roots(str(root / "ckpt")) == (str(root / "ckpt"),)
    (root / "m.gguf").write_bytes(b"")
    assert default_roots(str(root / "m.gguf")) == (str(root),)


def _stats(step: int, state: str = "serving", version: str = "0") -> SchedulerStats:
    return SchedulerStats(step, 0, 0, 0, 0.0, 10, 0, 0, 0, engine_state=state, weight_version=version)


def test_cp_engine_status_transitions():
    current = {"stats": None}
    status = EngineStatus(lambda: current["stats"])
    assert status.snapshot() == ("serving", "0")
    with status.closing("sleeping"):
        assert status.engine_state == "sleeping" and status.settled_state == "serving"
        current["stats"] = _stats(1)  # a step finishing meanwhile does not reopen admission
        assert status.engine_state == "sleeping"
    status.settle(state="sleeping")
    assert status.is_sleeping and status.snapshot() == ("sleeping", "0")
    assert status.is_sleeping  # the stats message current at the reply is stale
    current["stats"] = _stats(2, "serving", "0")  # newer stats win
    assert not status.is_sleeping
    status.settle(weight_version="v2")  # an update: state kept, version replaced
    assert status.snapshot() == ("serving", "v2")
    current["stats"] = _stats(3, "paused", "v2")
    assert status.is_paused and status.weight_version == "v2"


def test_cp_body_validation():
    assert parse_body(SleepRequest, b"").level == 1
    assert parse_body(SleepRequest, b'{"level": 2, "mode": "wait", "extra": 1}').mode == "wait"
    for body, param in [(b'{"level": 3}', "level"), (b'{"level": "1"}', "level"), (b'{"mode": "x"}', "mode")]:
        with pytest.raises(AdminError) as info:
            parse_body(SleepRequest, body)
        assert info.value.status == 400 and info.value.param == param
    with pytest.raises(AdminError, match="malformed JSON"):
        parse_body(SleepRequest, b"{")
    with pytest.raises(AdminError, match="JSON object"):
        parse_body(SleepRequest, b"[1]")
    with pytest.raises(AdminError, match="same length"):
        parse_body(UpdateFromDistributedRequest, b'{"names": ["a"], "dtypes": [], "shapes": [[1]]}')
    with pytest.raises(AdminError, match="unknown dtype"):
        parse_body(UpdateFromDistributedRequest, b'{"names": ["a"], "dtypes": ["float33"], "shapes": [[1]]}')
    ok = parse_body(UpdateFromDistributedRequest,
                    b'{"names": ["a"], "dtypes": ["torch.bfloat16"], "shapes": [[2, 3]]}')
    assert ok.dtypes == ["bfloat16"] and ok.flush_cache is True
    with pytest.raises(AdminError, match="rank_offset"):
        parse_body(InitGroupRequest, b'{"master_address": "h", "master_port": 1, "rank_offset": 2, "world_size": 2}')
    assert parse_bool("TRUE", "x", False) is True and parse_bool(None, "x", True) is True
    with pytest.raises(AdminError):
        parse_bool("maybe", "x", True)


def test_cp_safetensors_check():
    data = save({"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)})
    assert check_safetensors(data) == (2, 2 * 3 * 4 + 4 * 2)
    for bad in (b"", b"not a file", data[:-3], b"\xff" * 8 + data[8:]):
        with pytest.raises(ValueError, match="safetensors"):
            check_safetensors(bad)
    with pytest.raises(ValueError, match="no tensors"):
        check_safetensors(save({}))


def test_cp_buckets():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([4, 4, 10, 1, 1])]  # float32: 16, 16, 40, 4, 4 bytes
    names = [[name for name, _ in bucket] for bucket in _buckets(tensors, 32)]
    assert names == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert len(_buckets(tensors, 1 << 30)) == 1


def test_cp_settle_keeps_frozen_stats_classes():
    # EngineStatus compares stats by identity: equal-valued copies still count as new messages.
    first = _stats(5)
    current = {"stats": first}
    status = EngineStatus(lambda: current["stats"])
    status.settle(state="paused")
    current["stats"] = attrs.evolve(first)
    assert status.settled_state == "serving"
