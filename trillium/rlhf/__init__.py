"""Trainer-side client: push fresh weights into a running `trillium serve`.

    from trillium.rlhf import WeightSync

    sync = WeightSync("http://127.0.0.1:8001", admin_token)
    sync.init_group(master_address="127.0.0.1", master_port=29500)
    sync.push(model.named_parameters(), version="step-42")
    sync.close()

See `weight_sync.py` for the three paths (distributed broadcast, disk,
safetensors over HTTP) and `admin_client.py` for sleep / wake / pause.
Needs torch (and, for the group recipe, the torch-only module
`trillium.distributed.update_group`); no server process imports.
"""

from trillium.rlhf.admin_client import AdminClient, AdminRequestError
from trillium.rlhf.weight_sync import DEFAULT_BUCKET_BYTES, WeightSync

__all__ = ["AdminClient", "AdminRequestError", "DEFAULT_BUCKET_BYTES", "WeightSync"]
