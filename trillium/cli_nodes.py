"""`trillium serve` on more than one host: vLLM's multi-node flags, their refusals, the headless node.

    add_node_args(serve)      --nnodes, --node-rank, --master-addr, --master-port, --headless,
                              --link-secret-file; vLLM's multi-node data-parallel flags (refused)
    check_node_args(args)     SystemExit naming the flag for every combination not built
    node_secret(args)         the deployment's link secret (hex) from --link-secret-file, or None

What is built (README "More than one host"): one tensor-parallel engine over
`--nnodes` hosts, `--tensor-parallel-size / --nnodes` ranks on each (vLLM's
multi-node serving without Ray: vllm-project/vllm, vllm/engine/arg_utils.py
`--nnodes -n`, `--node-rank -r`, `--master-addr`, `--master-port`;
vllm/entrypoints/cli/serve.py `--headless`). Data-parallel replicas on other
hosts (vLLM's `--data-parallel-size-local`, `--data-parallel-address`,
`--data-parallel-rpc-port`, `--data-parallel-start-rank`) are not: those flags
are start-up errors naming them.
"""

from __future__ import annotations

import argparse

# vLLM's ParallelConfig.master_port default (vllm/config/parallel.py).
DEFAULT_MASTER_PORT = 29501
_DP_MULTI_NODE_FLAGS = ("--data-parallel-size-local", "--data-parallel-address", "--data-parallel-rpc-port",
                        "--data-parallel-start-rank")


def add_node_args(serve) -> None:
    group = serve.add_argument_group(
        "More than one host (vLLM's multi-node flags: one tensor-parallel engine over --nnodes hosts)")
    group.add_argument("--nnodes", "-n", type=int, default=1,
                       help="hosts the tensor-parallel ranks spread over (--tensor-parallel-size / --nnodes "
                            "ranks each); node 0 runs the api, the others --headless")
    group.add_argument("--node-rank", "-r", type=int, default=0, help="this host's index, 0..nnodes-1")
    group.add_argument("--master-addr", default="127.0.0.1",
                       help="address of node 0 every host reaches: rank 0's torch.distributed store binds "
                            "it (and only it). The store and the collectives are unauthenticated and "
                            "unencrypted: a private network only (the ranks prove --link-secret-file)")
    group.add_argument("--master-port", type=int, default=None,
                       help=f"port of that store (default {DEFAULT_MASTER_PORT} with --nnodes > 1, as "
                            "vLLM's; on one host a free loopback port)")
    group.add_argument("--headless", action="store_true",
                       help="run only this node's executor ranks (no api, no HTTP); needs --node-rank >= 1")
    group.add_argument("--link-secret-file", default=None, metavar="PATH",
                       help="file with the deployment's secret (64 hex digits, mode 600, the same file on "
                            "every host, e.g. `openssl rand -hex 32`); needed with --nnodes > 1. Every "
                            "engine link and every rank proves it; never logged")
    for flag in _DP_MULTI_NODE_FLAGS:
        group.add_argument(flag, default=None, help="refused: data-parallel replicas on other hosts are not "
                                                    "built; --nnodes spreads one tensor-parallel engine")


def check_node_args(args) -> None:
    """SystemExit naming the flag of each multi-node combination that is not built."""
    for flag in _DP_MULTI_NODE_FLAGS:
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            raise SystemExit(f"{flag}: data-parallel replicas on other hosts are not supported; Trillium "
                             "spreads one tensor-parallel engine over hosts (--nnodes, --node-rank, "
                             "--master-addr, --headless) and runs --data-parallel-size replicas on one host")
    nnodes, node_rank, tp = args.nnodes, args.node_rank, args.tensor_parallel_size
    refusals = (
        (nnodes < 1, f"--nnodes {nnodes}: must be >= 1"),
        (not 0 <= node_rank < nnodes, f"--node-rank {node_rank}: must be in 0..{nnodes - 1} (--nnodes {nnodes})"),
        (nnodes > 1 and (tp < nnodes or tp % nnodes),
         f"--nnodes {nnodes}: spreads the tensor-parallel ranks evenly over the hosts; --tensor-parallel-size "
         f"{tp} must be a multiple of it"),
        (nnodes > 1 and args.data_parallel_size > 1,
         f"--nnodes {nnodes} with --data-parallel-size {args.data_parallel_size}: replicas across hosts are "
         "not supported"),
        (nnodes > 1 and not args.link_secret_file,
         f"--nnodes {nnodes}: give every host the same --link-secret-file (the ranks prove it to each other)"),
        (args.headless and node_rank == 0,
         "--headless: node 0 (--node-rank 0) runs the api; --headless is for --node-rank 1.."),
        (node_rank > 0 and not args.headless,
         f"--node-rank {node_rank}: the api runs on node 0 only; start this host with --headless"),
        (args.master_port is not None and not 0 < args.master_port < 65536,
         f"--master-port {args.master_port}: not a TCP port"),
    )
    for refused, message in refusals:
        if refused:
            raise SystemExit(message)


def node_secret(args) -> str | None:
    if not args.link_secret_file:
        return None
    from trillium.distributed.nodes import read_link_secret

    try:
        return read_link_secret(args.link_secret_file)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def node_engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig fields of these flags (absent on commands without them: one host)."""
    nnodes = getattr(args, "nnodes", 1)
    port = getattr(args, "master_port", None)
    if port is None:
        port = DEFAULT_MASTER_PORT if nnodes > 1 else 0
    return dict(tp_nnodes=nnodes, tp_master_port=port, tp_master_addr=getattr(args, "master_addr", "127.0.0.1"))
