"""`control_plane/uploads.py`: a tensor upload streamed to a temp file under a size cap.

The body arrives in chunks (as Quart's `request.body` yields them); over the
cap it is a 413 and the partial file is gone; within it the file holds the
bytes, `head` the first ones (the JSON sniff), and the file is deleted when
the block ends, also on an error. The header check reads sizes from the
header only (a truncated file is a ValueError).
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save

from trillium.control_plane.errors import AdminError
from trillium.control_plane.uploads import check_safetensors_file, streamed_upload


async def chunks(data: bytes, size: int = 1000):
    for start in range(0, len(data), size):
        yield data[start:start + size]


async def test_within_the_cap_the_file_holds_the_body_and_is_removed():
    data = save({"a": torch.zeros(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)})
    async with streamed_upload(chunks(data, 7), limit_bytes=len(data)) as upload:
        with open(upload.path, "rb") as f:
            assert f.read() == data
        assert upload.num_bytes == len(data) and data.startswith(upload.head)
        assert oct(os.stat(upload.path).st_mode & 0o777) == "0o600"
        assert check_safetensors_file(upload.path) == (2, 3 * 4 * 4 + 2 * 2)
    assert not os.path.exists(upload.path)


async def test_over_the_cap_is_413_and_leaves_no_file(monkeypatch):
    import tempfile

    made = []
    real_mkstemp = tempfile.mkstemp

    def recording_mkstemp(*args, **kwargs):
        made.append(real_mkstemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkstemp", recording_mkstemp)
    with pytest.raises(AdminError) as raised:
        async with streamed_upload(chunks(b"x" * 5000), limit_bytes=4096):
            pytest.fail("an upload over the cap reached the route")
    assert raised.value.status == 413
    assert len(made) == 1 and not os.path.exists(made[0][1])


async def test_an_error_inside_removes_the_file():
    data = save({"a": torch.zeros(2)})
    with pytest.raises(RuntimeError):
        async with streamed_upload(chunks(data), limit_bytes=1 << 20) as upload:
            path = upload.path
            raise RuntimeError("the engine refused it")
    assert not os.path.exists(path)


def test_truncated_file_is_a_value_error(tmp_path):
    data = save({"a": torch.zeros(64)})
    path = tmp_path / "cut.safetensors"
    path.write_bytes(data[: len(data) - 10])
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        check_safetensors_file(str(path))
    (tmp_path / "empty.safetensors").write_bytes(save({}))
    with pytest.raises(ValueError, match="no tensors"):
        check_safetensors_file(str(tmp_path / "empty.safetensors"))
