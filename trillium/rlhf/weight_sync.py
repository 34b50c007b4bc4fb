"""`WeightSync`: push a trainer's weights into a running `trillium serve`.

    sync = WeightSync("http://127.0.0.1:8001", token)
    sync.init_group(master_address="127.0.0.1", master_port=29500)   # trainer = rank 0
    for step in range(num_steps):
        train_one_step(model)
        sync.push(model.named_parameters(), version=f"step-{step}")
    sync.close()

Three paths, one call each:

- `push` (distributed): POST /update_weights_from_distributed with the
  names, dtypes and shapes from a background thread, while this thread
  broadcasts each tensor from rank 0 in the same order; the call returns
  when the engine has loaded them. Tensors are grouped into buckets of at
  most `bucket_bytes` (a tensor larger than that is a bucket of its own):
  one HTTP call per bucket. With more than one bucket the engine is paused
  (mode "wait": requests in flight finish on the old weights) around the
  buckets and resumed after, unless the caller had paused it already; the
  version changes once, with the last bucket (the earlier ones re-send the
  version being served). So no request ever runs on half-updated weights.
- `push_from_disk(path)`: the engine reads a checkpoint directory (which
  must lie under the server's --allowed-weight-paths).
- `push_tensors({name: tensor})`: one safetensors file over HTTP.

`version=None` lets the engine bump the version ("7" -> "8", "step-9" ->
"step-10"). Names are Hugging Face parameter names (`model.named_parameters()`
of a transformers model); the engine checks names and shapes (400 on a
mismatch, old weights kept).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Iterable, Mapping

import torch

from trillium.rlhf.admin_client import AdminClient, AdminRequestError
from trillium.rlhf.group import WeightUpdateGroup, free_port, wait_work

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 1 << 30
DEFAULT_GROUP_NAME = "weight_update_group"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _buckets(tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += nbytes
    return buckets


class WeightSync:
    def __init__(self, admin_url: str, token: str, *, timeout_s: float = 600.0) -> None:
        self.admin = AdminClient(admin_url, token, timeout_s=timeout_s)
        self.timeout_s = timeout_s
        self.group: WeightUpdateGroup | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-http")

    # -- distributed ------------------------------------------------------

    def init_group(
        self,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        world_size: int = 2,
        backend: str = "gloo",
        group_name: str = DEFAULT_GROUP_NAME,
        *,
        timeout_s: float = 60.0,
    ) -> None:
        """Form the weight-update group: this process is rank 0, the engine ranks 1..world_size-1."""
        if self.group is not None:
            raise RuntimeError("a weight update group is already initialized; close() it first")
        master_port = master_port or free_port()
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": 1,
                "world_size": world_size, "group_name": group_name, "backend": backend, "timeout_s": timeout_s}
        # WHY two threads: the engine answers only once the group is formed, which needs us
        # too; and if the engine refuses at once (a group already open), we must not sit in
        # the rendezvous until its timeout.
        reply = self._pool.submit(self.admin.post, "/init_weights_update_group", body, timeout_s=timeout_s + 60)
        formed: dict = {}

        def form() -> None:
            try:
                formed["group"] = WeightUpdateGroup.create(
                    master_address, master_port, rank=0, world_size=world_size, backend=backend,
                    group_name=group_name, timeout_s=timeout_s)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                formed["error"] = exc

        former = threading.Thread(target=form, name="weight-sync-rendezvous", daemon=True)
        former.start()
        while former.is_alive():
            if reply.done() and reply.exception() is not None:
                raise reply.exception()  # the rendezvous thread gives up by itself at its timeout
            former.join(0.05)
        if "error" in formed:
            _quietly(reply)
            raise formed["error"]
        group = formed["group"]
        try:
            reply.result()
        except BaseException:
            group.close()
            raise
        self.group = group
        log.info("weight update group %r formed (%s, world size %d)", group_name, backend, world_size)

    def push(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]],
        version: str | None = None,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        flush_cache: bool = True,
    ) -> str:
        """Broadcast every tensor to the engine; returns the weight version now served."""
        if self.group is None:
            raise RuntimeError("call init_group() before push()")
        device = self.group.device()
        tensors = [(name, t.detach().to(device).contiguous()) for name, t in named_parameters]
        if not tensors:
            raise ValueError("push() needs at least one tensor")
        buckets = _buckets(tensors, bucket_bytes)
        pause = len(buckets) > 1 and not self.admin.is_paused()
        if pause:
            self.admin.pause(mode="wait")
        try:
            current = self.admin.weight_version() if len(buckets) > 1 else None
            reply = None
            for index, bucket in enumerate(buckets):
                last = index == len(buckets) - 1
                reply = self._push_bucket(bucket, version if last else current, flush_cache and last)
        finally:
            if pause:
                self.admin.resume()
        return str(reply["weight_version"])

    def _push_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: str | None, flush_cache: bool):
        body = {
            "names": [name for name, _ in bucket],
            "dtypes": [dtype_name(t.dtype) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "weight_version": version,
            "flush_cache": flush_cache,
        }
        reply = self._pool.submit(self.admin.post, "/update_weights_from_distributed", body)

        def failed() -> BaseException | None:
            if reply.done() and reply.exception() is not None:
                return reply.exception()
            return None

        try:
            # WHY queue them all first: gloo runs the queued broadcasts back to back;
            # waiting for each before starting the next added a poll interval per tensor.
            works = [self.group.broadcast_async(tensor, src=0) for _, tensor in bucket]
            for work in works:
                wait_work(work, failed, self.timeout_s)
        except BaseException:
            # WHY: a half-finished broadcast leaves the group out of step; it must be re-formed.
            log.error("weight broadcast failed; the update group must be re-initialized")
            self.group.close()
            self.group = None
            _quietly(reply)
            raise
        return reply.result()

    # -- disk and HTTP ------------------------------------------------------

    def push_from_disk(self, path: str, version: str | None = None, *, flush_cache: bool = True,
                       draft_model_only: bool = False) -> str:
        """The engine loads the checkpoint at `path` (under the server's --allowed-weight-paths).
        `draft_model_only`: into the speculative draft instead; returns its draft_weight_version."""
        body = {"model_path": str(path), "weight_version": version, "flush_cache": flush_cache}
        reply = self.admin.post("/update_weights_from_disk", {**body, **_draft(draft_model_only)})
        return str(reply["draft_weight_version" if draft_model_only else "weight_version"])

    def push_tensors(self, tensors: Mapping[str, torch.Tensor], version: str | None = None, *,
                     flush_cache: bool = True, draft_model_only: bool = False) -> str:
        """Send `tensors` as one safetensors file over HTTP (`draft_model_only`: as push_from_disk)."""
        from safetensors.torch import save

        payload: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in tensors.items():
            tensor = tensor.detach().cpu().contiguous()
            # WHY clone shared storage: safetensors refuses aliased tensors (tied embeddings).
            if tensor.data_ptr() in seen:
                tensor = tensor.clone()
            seen.add(tensor.data_ptr())
            payload[name] = tensor
        data = save(payload)
        reply = self.admin.request("POST", "/update_weights_from_tensor", data=data,
                                   params={"weight_version": version, "flush_cache": flush_cache,
                                           **_draft(draft_model_only)},
                                   content_type="application/octet-stream")
        return str(reply["draft_weight_version" if draft_model_only else "weight_version"])

    # -- teardown -------------------------------------------------------------

    def close(self) -> None:
        """Destroy the update group on both sides (idempotent)."""
        group, self.group = self.group, None
        if group is not None:
            try:
                self.admin.post("/destroy_weights_update_group")
            except (AdminRequestError, OSError) as exc:
                log.warning("destroy_weights_update_group failed: %s", exc)
            group.close()

    def __enter__(self) -> "WeightSync":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _draft(draft_model_only: bool) -> dict:
    """The routing field, sent only when set (a server without speculative decoding takes the rest)."""
    return {"draft_model_only": True} if draft_model_only else {}


def _quietly(future: concurrent.futures.Future) -> None:
    """Wait for a background HTTP call we no longer need; log its error."""
    try:
        future.result()
    except Exception as exc:  # noqa: BLE001 - already failing; keep the first error
        log.warning("admin call failed too: %s", exc)
