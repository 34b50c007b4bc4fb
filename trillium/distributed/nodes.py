"""More than one host: where the tensor-parallel ranks run, and how they prove they belong.

    ranks_on_node(size, nnodes, node_rank) -> range   the global ranks one host runs
    local_rank(rank, size, nnodes) -> int             a rank's index on its host (its cuda:i, its cores)
    read_link_secret(path) -> str                     the deployment's secret (hex), from --link-secret-file
    config_fingerprint(engine) -> bytes               what every rank must agree on
    prove_membership(group, key, fingerprint)         every rank checks every other one (raises on a stranger)

The shape is vLLM's multi-node serving without Ray (`vllm serve --nnodes N
--node-rank R --master-addr A --master-port P`, `--headless` on the nodes
that run no api: vllm-project/vllm, vllm/entrypoints/cli/serve.py
`run_headless`, vllm/config/parallel.py `nnodes` / `node_rank` /
`master_addr` / `master_port`): node 0 runs the api, the scheduler, the
detokenizer and executor ranks 0..k-1; node r runs ranks r*k..(r+1)*k-1
(k = tensor_parallel_size / nnodes), which follow rank 0's step broadcast
(`executor/tp_fanout.py`). Nothing but torch.distributed crosses the hosts:
the ZeroMQ actors all live on node 0.

WHY a membership proof. torch.distributed's TCPStore (rank 0, at
master-addr:master-port) and gloo's pair sockets are unauthenticated: any
peer that reaches the port during start-up can take a rank's place and then
receive every step (prompts) and feed the all-reduces. Right after the
group forms, before any weight or step moves, rank 0 broadcasts a fresh
nonce and every rank answers HMAC(deployment secret, nonce | rank |
fingerprint of its engine config); every rank checks every answer. A rank
without the secret (a stranger, or a node given another --link-secret-file)
or with another config (other model or engine flags: num_blocks, dtype, ...
that would silently corrupt the shared block ids) fails start-up on every
rank, naming the rank and which of the two differs. What it does not do:
encrypt the collectives. Run the hosts on a private network (README
"More than one host").
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat

from trillium.actors.link_auth import SECRET_BYTES, LinkKey

# EngineConfig fields a host may set for itself: the model's path on its disk, its device and threads;
# and those only the api and the scheduler read (node 0's alone), which no rank past the first uses.
_NODE_LOCAL_FIELDS = ("model", "tokenizer", "device", "num_threads", "tp_collective_timeout_s",
                      "served_model_name", "otlp_traces_endpoint", "collect_detailed_traces", "generation_config",
                      "override_generation_config", "max_queue_time_s", "scheduling_policy")


class MembershipError(RuntimeError):
    """A rank of the tensor-parallel group did not prove the deployment secret or config."""


def ranks_on_node(size: int, nnodes: int, node_rank: int) -> range:
    per_node = size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def local_rank(rank: int, size: int, nnodes: int) -> int:
    return rank % (size // nnodes)


def read_link_secret(path: str) -> str:
    """The hex secret in `path` (64 hex digits, whitespace stripped); ValueError naming the flag.

    The file must not be readable by group or others (as ssh treats a private key)."""
    try:
        mode = os.stat(path).st_mode
        with open(path) as f:
            text = f.read().strip()
    except OSError as exc:
        raise ValueError(f"--link-secret-file {path}: cannot read it ({exc.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"--link-secret-file {path}: readable by group or others (mode "
                         f"{stat.S_IMODE(mode):o}); chmod 600 it")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"--link-secret-file {path}: must hold {2 * SECRET_BYTES} hex digits "
                         f"({SECRET_BYTES} random bytes), e.g. from `openssl rand -hex {SECRET_BYTES}`")
    return secret.hex()


def config_fingerprint(engine) -> bytes:
    """SHA-256 of the engine config without the node-local fields (see _NODE_LOCAL_FIELDS)."""
    fields = json.loads(engine.to_bytes())
    for name in _NODE_LOCAL_FIELDS:
        fields.pop(name, None)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).digest()


def _answer(key: LinkKey, nonce: bytes, rank: int, fingerprint: bytes) -> bytes:
    return hmac.digest(key.role_key("executor-rank"), nonce + rank.to_bytes(4, "big") + fingerprint, "sha256")


def prove_membership(group, key: LinkKey, fingerprint: bytes) -> None:
    """Every rank: prove the secret and config, check every other rank's proof (see the module docstring).

    `group`: a TpGroup (its `broadcast_bytes` from rank 0 and `all_gather_bytes`)."""
    nonce = group.broadcast_bytes(os.urandom(32) if group.is_first else None)
    answers = group.all_gather_bytes(fingerprint + _answer(key, nonce, group.rank, fingerprint))
    wrong_config, wrong_secret = [], []
    for rank, answer in enumerate(answers):
        their_print, their_mac = answer[:32], answer[32:]
        if not hmac.compare_digest(their_mac, _answer(key, nonce, rank, their_print)):
            wrong_secret.append(rank)
        elif their_print != fingerprint:
            wrong_config.append(rank)
    if wrong_secret:
        raise MembershipError(
            f"tensor-parallel rank(s) {wrong_secret} did not prove the deployment secret: a peer that is not "
            "this deployment's, or a node started with another --link-secret-file; refusing to serve with it")
    if wrong_config:
        raise MembershipError(
            f"tensor-parallel rank(s) {wrong_config} run another engine config than rank {group.rank}: give "
            "every node the same model and engine flags (--max-model-len, --kv-cache-memory, --dtype, ...)")
