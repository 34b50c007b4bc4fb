"""Safetensors uploads streamed to a private temp file, under a size cap.

WHY: buffering a 100 MB upload cost about 4x its size across processes
(Quart's buffered body, the parsed copy, the socket frame, the executor's
copy). Here the body goes chunk by chunk into a file (mode 0600, in the
system temp dir, named `trillium-upload-*`); the api checks the file's
header with the safetensors library (no data read, no pickle) and the
executor reads the tensors from it once (`UpdateWeightsFromTensors.safetensors_path`).
The route deletes the file when the update is answered, whatever happened.

    async with streamed_upload(body, limit_bytes) as upload:   # 413 over the cap
        upload.path, upload.num_bytes, upload.head (first bytes, for the JSON sniff)
    check_safetensors_file(path) -> (num_tensors, tensor bytes)   # ValueError when malformed
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import AsyncIterable, AsyncIterator

import attrs
import trio

from trillium.control_plane.errors import AdminError

_FLUSH_BYTES = 8 << 20  # WHY: one worker-thread write per 8 MiB, not one per 64 KiB chunk
HEAD_BYTES = 1 << 20  # what the JSON sniff may look at


@attrs.define
class Upload:
    path: str
    num_bytes: int = 0
    head: bytes = b""


@contextlib.asynccontextmanager
async def streamed_upload(body: AsyncIterable[bytes], limit_bytes: int) -> AsyncIterator[Upload]:
    fd, path = tempfile.mkstemp(prefix="trillium-upload-", suffix=".safetensors")  # 0600
    upload = Upload(path)
    try:
        with os.fdopen(fd, "wb") as file:
            pending: list[bytes] = []
            pending_bytes = 0
            async for chunk in body:
                upload.num_bytes += len(chunk)
                if upload.num_bytes > limit_bytes:
                    raise AdminError(413, f"the upload exceeds the limit of {limit_bytes} bytes",
                                     code="payload_too_large")
                if len(upload.head) < HEAD_BYTES:
                    upload.head += chunk[: HEAD_BYTES - len(upload.head)]
                pending.append(chunk)
                pending_bytes += len(chunk)
                if pending_bytes >= _FLUSH_BYTES:
                    await trio.to_thread.run_sync(file.write, b"".join(pending))
                    pending, pending_bytes = [], 0
            if pending:
                await trio.to_thread.run_sync(file.write, b"".join(pending))
        yield upload
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def check_safetensors_file(path: str) -> tuple[int, int]:
    """(number of tensors, bytes of tensor data) from the header; ValueError when not a safetensors file."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as tensors:
            names = list(tensors.keys())
            num_bytes = 0
            for name in names:
                view = tensors.get_slice(name)
                num_bytes += math.prod(view.get_shape()) * _dtype_bytes(view.get_dtype())
    except Exception as exc:  # WHY: the Rust parser raises its own SafetensorError for every defect
        raise ValueError(f"not a valid safetensors file: {exc}") from None
    if not names:
        raise ValueError("the safetensors file holds no tensors")
    return len(names), num_bytes


_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}


def _dtype_bytes(name: str) -> int:
    return _DTYPE_BYTES.get(name.upper(), 1)
