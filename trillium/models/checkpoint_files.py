"""Where a checkpoint's files are, and GGUF header values, without importing torch.

The tokenizer (api process) and the loader (executor) both resolve paths
here: an HF directory's safetensors files, or the GGUF file a path names.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

SAFETENSORS_INDEX = "model.safetensors.index.json"


def find_gguf_file(path: str | Path) -> Path | None:
    """The GGUF file `path` names: itself, or the single .gguf in a directory without config.json."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise ValueError(f"{path} holds several .gguf files; pass one of them: {[f.name for f in found]}")
    return None


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files, in index order when sharded."""
    path = Path(path)
    index = path / SAFETENSORS_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in dict.fromkeys(weight_map.values())]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {pickled}: pickle checkpoints are not loaded; convert to safetensors)" if pickled else ""
        raise FileNotFoundError(f"no *.safetensors in {path}{hint}")
    return files


_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read_value(f: BinaryIO, value_type: int, keep: bool) -> Any:
    if value_type in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[value_type]
        (value,) = struct.unpack(fmt, f.read(struct.calcsize(fmt)))
        return value
    if value_type == _STRING:
        (length,) = struct.unpack("<Q", f.read(8))
        data = f.read(length)
        return data.decode("utf-8", errors="replace") if keep else None
    if value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in _SCALAR_FORMATS:
            f.seek(count * struct.calcsize(_SCALAR_FORMATS[item_type]), 1)
        else:
            for _ in range(count):
                _read_value(f, item_type, keep=False)
        return ("<array>", count)
    raise ValueError(f"unknown GGUF value type {value_type}")


def read_gguf_header(path: str | Path) -> dict[str, Any]:
    """Scalar and string key/values of a GGUF header; arrays become ("<array>", length).

    WHY: GGUFReader parses every token string of the vocabulary into numpy
    views (seconds for a 50k vocabulary); the tokenizer only needs a few ids.
    """
    with open(path, "rb") as f:
        magic, version, _num_tensors, num_kv = struct.unpack("<4sIQQ", f.read(24))
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path}: not a little-endian GGUF v2+ file")
        out: dict[str, Any] = {}
        for _ in range(num_kv):
            (key_len,) = struct.unpack("<Q", f.read(8))
            key = f.read(key_len).decode("utf-8")
            (value_type,) = struct.unpack("<I", f.read(4))
            out[key] = _read_value(f, value_type, keep=True)
    return out
