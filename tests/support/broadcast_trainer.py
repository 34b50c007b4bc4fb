"""A minimal trainer process for the distributed-update tests (run as a script).

    python tests/support/broadcast_trainer.py ADMIN_URL TOKEN CHECKPOINT_DIR VERSION [BUCKET_BYTES]

Loads the checkpoint's tensors, forms the weight-update group with the
server (this process is rank 0, gloo), pushes every tensor by broadcast,
destroys the group and prints {"weight_version", "second_init_status",
"second_init_s"} as its last line: while the group is open, a second
trainer's init is refused (409) at once, not after the rendezvous timeout.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from safetensors.torch import load_file

from trillium.rlhf import DEFAULT_BUCKET_BYTES, AdminRequestError, WeightSync


def main(admin_url: str, token: str, checkpoint: str, version: str, bucket_bytes: int) -> None:
    torch.set_num_threads(1)
    tensors = load_file(f"{checkpoint}/model.safetensors")
    with WeightSync(admin_url, token) as sync:
        sync.init_group(master_address="127.0.0.1", world_size=2, backend="gloo", timeout_s=60)
        started_s, status = time.monotonic(), None
        try:
            WeightSync(admin_url, token).init_group(master_address="127.0.0.1", timeout_s=60)
        except AdminRequestError as exc:
            status = exc.status
        second_init_s = time.monotonic() - started_s
        served = sync.push(tensors.items(), version=version, bucket_bytes=bucket_bytes)
    print(json.dumps({"weight_version": served, "second_init_status": status, "second_init_s": second_init_s}))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], args[1], args[2], args[3], int(args[4]) if len(args) > 4 else DEFAULT_BUCKET_BYTES)
