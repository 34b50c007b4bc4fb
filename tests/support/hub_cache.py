"""Lay a local checkpoint out as a Hugging Face Hub cache entry (no network), for offline tests.

    populate_hub_cache(cache_dir, "org/name", source_dir, commit="...") -> snapshot path

The layout is huggingface_hub's (docs: "Understand caching"): blobs named by
content hash under `models--org--name/blobs/`, the revision's files as
symlinks in `snapshots/<commit>/`, and `refs/main` holding the commit, so
`snapshot_download(..., local_files_only=True)` (what HF_HUB_OFFLINE=1 does)
finds it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

DEFAULT_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate_hub_cache(cache_dir: str | Path, repo_id: str, source_dir: str | Path, *,
                       commit: str = DEFAULT_COMMIT, ref: str = "main") -> Path:
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(Path(source_dir).iterdir()):
        if not file.is_file():
            continue
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(file, blob)
        link = snapshot / file.name
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(os.path.relpath(blob, snapshot), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot
