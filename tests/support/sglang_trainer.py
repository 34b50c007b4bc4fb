"""A trainer written the way SGLang's own RL test writes its trainer side (run as a script).

    python tests/support/sglang_trainer.py ADMIN_URL TOKEN CHECKPOINT_DIR VERSION PORT
                                           [--join-delay-s S] [--timeout-s T] [--never-join]

It imports torch, transformers and httpx, never Trillium: the group is
formed by the custom-group recipe that SGLang defines and RL frameworks
copy, written here from the facts of these files (not copied):

- `init_custom_process_group` in sgl-project/sglang
  python/sglang/srt/utils/common.py (formerly srt/utils.py): a `tcp://`
  rendezvous, `store.set_timeout`, `PrefixStore(group_name, store)`, torch's
  `_new_process_group_helper(world_size, rank, [], Backend(backend), store,
  group_name=..., backend_options=None, timeout=...)`, then
  `_world.pg_group_ranks[pg] = {i: i}`;
- the trainer side (`init_process_hf`) of sgl-project/sglang
  test/srt/rl/test_update_weights_from_distributed.py: rank 0 loads the
  post-training model with `AutoModelForCausalLM.from_pretrained`, forms
  the group with `init_custom_process_group(backend, init_method=
  "tcp://localhost:<port>", world_size, rank=0, group_name=
  "test_parameter_update_group")`, then calls
  `torch.distributed.broadcast(param, src=0, group=group)` for every
  parameter, in the order the engine was told; the engine side of that
  test POSTs `/init_weights_update_group {master_address, master_port,
  rank_offset, world_size, group_name, backend}`,
  `/update_weights_from_distributed {names, dtypes, shapes, group_name}` and
  `/destroy_weights_update_group {group_name}`. Here those three POSTs go
  from this process (a thread each, as the engine answers the first two
  only once the broadcasts meet it), with a `weight_version`.

With --join-delay-s the trainer POSTs the init and waits that long before it
joins; with --never-join it never does (the init must then time out); with
--join-only it destroys the group right after joining, pushing nothing.
Prints one JSON line: the statuses, the version served, and wall-clock
times (time.time()) of the init POST, the join and the init's answer.
NOTE: torch is imported after the init is POSTed (its import takes seconds
on a busy CI machine; the wait for the join overlaps it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import time

import httpx

GROUP_NAME = "test_parameter_update_group"


def init_custom_process_group(backend, init_method, timeout, world_size, rank, group_name):
    """The custom group of SGLang's utils: one of its own, beside any default process group."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)  # keys apart from other tenants of the store
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store,
        group_name=group_name, backend_options=None, timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("admin_url", "token", "checkpoint", "version"):
        parser.add_argument(name)
    parser.add_argument("port", type=int)
    parser.add_argument("--join-delay-s", type=float, default=0.0)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--never-join", action="store_true")
    parser.add_argument("--join-only", action="store_true")
    args = parser.parse_args()
    http = httpx.Client(base_url=args.admin_url, headers={"Authorization": f"Bearer {args.token}"},
                        timeout=args.timeout_s + 120)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    result: dict = {}

    init_body = {"master_address": "localhost", "master_port": str(args.port),  # a string, as SGLang's test sends it
                 "rank_offset": 1, "world_size": 2,
                 "group_name": GROUP_NAME, "backend": "gloo", "timeout_s": args.timeout_s}

    def post_init() -> httpx.Response:
        response = http.post("/init_weights_update_group", json=init_body)
        result["init_answered_at"] = time.time()
        return response

    result["init_posted_at"] = time.time()
    init = pool.submit(post_init)
    if args.never_join:
        result["init_status"] = init.result().status_code
        print(json.dumps(result), flush=True)
        return

    import torch
    import torch.distributed

    torch.set_num_threads(1)
    if not args.join_only:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    time.sleep(max(0.0, args.join_delay_s - (time.time() - result["init_posted_at"])))
    result["joining_at"] = time.time()
    group = init_custom_process_group(
        backend="gloo", init_method=f"tcp://localhost:{args.port}",
        timeout=datetime.timedelta(seconds=args.timeout_s), world_size=2, rank=0, group_name=GROUP_NAME,
    )
    result["joined_at"] = time.time()
    result["init_status"] = init.result().status_code
    if not args.join_only:
        push(http, pool, group, model, args.version, result)
    result["destroy_status"] = http.post("/destroy_weights_update_group", json={"group_name": GROUP_NAME}).status_code
    # NOTE: a gloo group still alive at interpreter exit aborts the process.
    torch.distributed.destroy_process_group(group)
    print(json.dumps(result), flush=True)


def push(http, pool, group, model, version: str, result: dict) -> None:
    """POST the update (a thread: it answers once the broadcasts are in) while broadcasting every parameter."""
    import torch
    import torch.distributed

    names = [name for name, _ in model.named_parameters()]
    update_body = {
        "names": names,
        "dtypes": ["float32"] * len(names),
        "shapes": [list(model.get_parameter(name).shape) for name in names],
        "group_name": GROUP_NAME,
        "weight_version": version,
    }
    update = pool.submit(http.post, "/update_weights_from_distributed", json=update_body)
    with torch.no_grad():
        for name in names:
            torch.distributed.broadcast(model.get_parameter(name).data, src=0, group=group)
    reply = update.result()
    result["update_status"] = reply.status_code
    result["weight_version"] = reply.json().get("weight_version")


def join_and_push(http, init, port: int, world_size: int, model, version: str) -> dict:
    """The in-process trainer of the TP and DP tests: POST /init_weights_update_group through
    `init(world_size, port)` while joining as rank 0 (the recipe above, in a thread instead of a
    process), push every parameter, destroy the group. The statuses: init, update, destroy."""
    import torch.distributed

    result: dict = {}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(init, world_size, port)
        group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", datetime.timedelta(seconds=60),
                                          world_size, 0, GROUP_NAME)
        try:
            reply = joined.result()
            result["init_status"], result["init_text"] = reply.status_code, reply.text
            if reply.status_code == 200:
                push(http, pool, group, model, version, result)
            destroyed = http.post("/destroy_weights_update_group", json={"group_name": GROUP_NAME})
            result["destroy_status"], result["destroy_text"] = destroyed.status_code, destroyed.text
        finally:
            torch.distributed.destroy_process_group(group)
    return result


if __name__ == "__main__":
    main()
