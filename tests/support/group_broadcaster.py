"""The trainer's torch side of an SGLang-style weight push (run as a script by tests/support/replay.py).

    python tests/support/group_broadcaster.py PORT GROUP_NAME WORLD_SIZE CHECKPOINT_DIR NAMES_JSON TIMEOUT_S

The HTTP calls of a framework's cycle are made by the test itself (in the
framework's order, with its bodies); this process only does what the
framework's trainer rank 0 does with torch: it forms the custom group the
way SGLang's `init_custom_process_group` (sgl-project/sglang
python/sglang/srt/utils/common.py) and its copies in slime
(slime/utils/distributed_utils.py `init_process_group`) and AReaL form it
-- a `tcp://` rendezvous as rank 0, `PrefixStore(group_name, store)`,
torch's `_new_process_group_helper` -- then broadcasts every tensor of the
checkpoint named in NAMES_JSON, in that order, from rank 0 (slime:
`dist.broadcast(param.data, 0, group=group)` in
slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py).
It imports torch and safetensors, never Trillium. Prints "joined" once the
group exists and "done" after the last broadcast; exits 1 on a timeout.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed
from safetensors.torch import load_file
# WHY a plain import: this file runs as a script, so tests/support is on sys.path.
from sglang_trainer import init_custom_process_group


def main(port: int, group_name: str, world_size: int, checkpoint: str, names_path: str, timeout_s: float) -> None:
    torch.set_num_threads(1)
    tensors = load_file(f"{checkpoint}/model.safetensors")
    with open(names_path) as f:
        names = json.load(f)
    group = init_custom_process_group(
        "gloo", f"tcp://127.0.0.1:{port}", datetime.timedelta(seconds=timeout_s), world_size, 0, group_name,
    )
    print("joined", flush=True)
    handles = [torch.distributed.broadcast(tensors[name], 0, group=group, async_op=True) for name in names]
    for handle in handles:
        handle.wait()
    # NOTE: a gloo group still alive at interpreter exit aborts the process.
    torch.distributed.destroy_process_group(group)
    print("done", flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), a[1], int(a[2]), a[3], a[4], float(a[5]))
