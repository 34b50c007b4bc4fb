"""`trillium serve` on more than one host: vLLM's multi-node flags, their refusals, the headless node.

    add_node_args(serve)      --nnodes, --node-rank, --master-addr, --master-port, --headless,
                              --link-secret-file; vLLM's multi-node data-parallel flags (refused)
    check_node_args(args)     SystemExit naming the flag for every combination not built
    node_secret(args)         the deployment's link secret (hex) from --link-secret-file, or None

What is built (README "Scaling out"): one tensor-parallel engine over
`--nnodes` hosts, `--tensor-parallel-size / --nnodes` ranks on each (vLLM's
multi-node serving without Ray: vllm-project/vllm, vllm/engine/arg_utils.py
`--nnodes -n`, `--node-rank -r`, `--master-addr`, `--master-port`;
vllm/entrypoints/cli/serve.py `--headless`); or data-parallel replicas on
other hosts (vLLM's `--data-parallel-size-local`, `--data-parallel-start-rank`,
`--data-parallel-address`, `--data-parallel-rpc-port`, same file; the join and
the links: data_parallel/remote.py). Not built, refused naming the flags: both
at once, tensor parallelism inside a remote replica.
"""

from __future__ import annotations

import argparse

# vLLM's ParallelConfig.master_port default (vllm/config/parallel.py).
DEFAULT_MASTER_PORT = 29501


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
                       help="run only this node's executor ranks (no api, no HTTP); needs --node-rank >= 1. "
                            "With --data-parallel-start-rank: only this host's data-parallel replicas")
    group.add_argument("--link-secret-file", default=None, metavar="PATH",
                       help="file with the deployment's secret (64 hex digits, mode 600, the same file on "
                            "every host, e.g. `openssl rand -hex 32`); needed with --nnodes > 1 and with data-parallel "
                            "replicas on other hosts. Every "
                            "engine link and every rank proves it; never logged")
    dp = serve.add_argument_group(
        "Data-parallel replicas on more than one host (vLLM's flags; README \"Scaling out\")")
    dp.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None,
                    help="replicas this host runs (default: all --data-parallel-size); on the api host, "
                         "fewer than --data-parallel-size leaves the rest to --headless hosts")
    dp.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=None,
                    help="--headless: the index of this host's first replica (the api host runs 0..)")
    dp.add_argument("--data-parallel-address", "-dpa", default=None,
                    help="the api host's address every host reaches; the api host binds its join socket "
                         "and one inbox per remote replica there (tcp://, authenticated by --link-secret-file)")
    dp.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=None,
                    help="the api host's join port P; remote replica i's api inbox listens on P + i")


def remote_replicas(args) -> bool:
    """Replicas on other hosts: this is their api host, or one of their --headless hosts."""
    local = args.data_parallel_size_local
    return args.data_parallel_start_rank is not None or (local is not None and local < args.data_parallel_size)


def _check_dp_remote(args) -> None:
    """SystemExit naming the flag of each data-parallel-across-hosts combination that is not built."""
    size, local = args.data_parallel_size, args.data_parallel_size_local
    start = args.data_parallel_start_rank or 0
    remote = remote_replicas(args)
    refusals = (
        (local is not None and not 0 < local <= size,
         f"--data-parallel-size-local {local}: must be in 1..{size} (--data-parallel-size {size})"),
        (not remote and (args.data_parallel_address or args.data_parallel_rpc_port),
         "--data-parallel-address / --data-parallel-rpc-port: only with replicas on other hosts "
         "(--data-parallel-size-local below --data-parallel-size, or --headless --data-parallel-start-rank)"),
        (remote and args.headless and args.data_parallel_start_rank is None,
         "--headless with --data-parallel-size-local: give --data-parallel-start-rank (this host's first replica)"),
        (remote and not args.headless and start != 0,
         f"--data-parallel-start-rank {start}: the api host runs replicas 0..; start other hosts with --headless"),
        (remote and args.headless and not 0 < start <= size - (local or 1),
         f"--data-parallel-start-rank {start}: a --headless host's replicas must lie in 1..{size - 1} "
         f"(replica 0 is the api host's; --data-parallel-size {size})"),
        (remote and (not args.data_parallel_address or args.data_parallel_rpc_port is None),
         "replicas on other hosts need --data-parallel-address and --data-parallel-rpc-port (the api host's)"),
        (remote and args.data_parallel_rpc_port is not None and not 0 < args.data_parallel_rpc_port < 65536 - size,
         f"--data-parallel-rpc-port {args.data_parallel_rpc_port}: not a TCP port (P .. P + size are used)"),
        (remote and not args.link_secret_file,
         "replicas on other hosts: give every host the same --link-secret-file (every tcp:// link proves it)"),
        (remote and args.nnodes > 1,
         f"--nnodes {args.nnodes} with replicas on other hosts: not supported (either one tensor-parallel "
         "engine over hosts, or data-parallel replicas on other hosts)"),
        (remote and args.tensor_parallel_size > 1,
         f"--tensor-parallel-size {args.tensor_parallel_size} with replicas on other hosts: tensor "
         "parallelism inside a remote replica is not supported"),
    )
    for refused, message in refusals:
        if refused:
            raise SystemExit(message)


def check_node_args(args) -> None:
    """SystemExit naming the flag of each multi-node combination that is not built."""
    _check_dp_remote(args)
    if remote_replicas(args):
        return
    nnodes, node_rank, tp = args.nnodes, args.node_rank, args.tensor_parallel_size
    refusals = (
        (nnodes < 1, f"--nnodes {nnodes}: must be >= 1"),
        (not 0 <= node_rank < nnodes, f"--node-rank {node_rank}: must be in 0..{nnodes - 1} (--nnodes {nnodes})"),
        (nnodes > 1 and (tp < nnodes or tp % nnodes),
         f"--nnodes {nnodes}: spreads the tensor-parallel ranks evenly over the hosts; --tensor-parallel-size "
         f"{tp} must be a multiple of it"),
        (nnodes > 1 and args.data_parallel_size > 1,
         f"--nnodes {nnodes} with --data-parallel-size {args.data_parallel_size}: replicas of a tensor-parallel "
         "engine over hosts are not supported (replicas on other hosts: --data-parallel-size-local)"),
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


def node_server_kwargs(args) -> dict:
    """ServerConfig fields of the data-parallel-across-hosts flags (the api host's)."""
    if not remote_replicas(args):
        return {}
    return dict(data_parallel_size_local=args.data_parallel_size_local,
                data_parallel_address=args.data_parallel_address, data_parallel_rpc_port=args.data_parallel_rpc_port)


def node_engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig fields of these flags (absent on commands without them: one host)."""
    nnodes = getattr(args, "nnodes", 1)
    port = getattr(args, "master_port", None)
    if port is None:
        port = DEFAULT_MASTER_PORT if nnodes > 1 else 0
    return dict(tp_nnodes=nnodes, tp_master_port=port, tp_master_addr=getattr(args, "master_addr", "127.0.0.1"))
