"""Which directories `update_weights_from_disk` may read: the allowed roots.

A requested path is resolved (`os.path.realpath`: symlinks and `..`
followed) and must lie at or under one resolved root, else 403. With no
roots, every disk update is refused. `trillium serve` defaults the roots
to the directory of `--model` (the model directory itself, or the folder
holding a .gguf file), so reloading the base checkpoint works out of the
box and nothing else does until `--allowed-weight-paths` says so.

Every file inside is resolved too (`escaping_links`): a directory under a
root may hold symlinks (to a file or a directory) that point out of every
root; such a request is a 403 naming them, before the engine opens
anything. NOTE: this is a check before the open, not an open that refuses
links (O_NOFOLLOW / openat2); whoever can swap a file for a link in between
can already write weights under the root, which is the trust the root grants.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import attrs


def _resolve_all(roots: Iterable[str]) -> tuple[str, ...]:
    return tuple(os.path.realpath(os.path.expanduser(root)) for root in roots if root)


@attrs.frozen
class WeightPathPolicy:
    roots: tuple[str, ...] = attrs.field(converter=_resolve_all, default=())

    def is_allowed(self, path: str) -> bool:
        resolved = os.path.realpath(os.path.expanduser(path))
        for root in self.roots:
            if resolved == root or resolved.startswith(root.rstrip(os.sep) + os.sep):
                return True
        return False

    def resolve(self, path: str) -> str:
        return os.path.realpath(os.path.expanduser(path))

    def escaping_links(self, path: str, max_entries: int = 100_000) -> list[str]:
        """Entries under the resolved directory `path` whose target lies outside every root
        (relative names, sorted; empty for a file or when all stay inside)."""
        root = self.resolve(path)
        if not os.path.isdir(root):
            return []
        escaping, seen = [], 0
        for directory, dirs, files in os.walk(root, followlinks=False):
            for name in (*dirs, *files):
                seen += 1
                if seen > max_entries:
                    return [*sorted(escaping), f"(more than {max_entries} entries: not checked)"]
                entry = os.path.join(directory, name)
                if os.path.islink(entry) and not self.is_allowed(entry):
                    escaping.append(os.path.relpath(entry, root))
        return sorted(escaping)


def default_roots(model: str) -> tuple[str, ...]:
    """The directory of --model: the model directory itself, or the folder of a model file."""
    path = os.path.realpath(model)
    return (path if os.path.isdir(path) else os.path.dirname(path),)


def split_path_list(values: Iterable[str] | None) -> tuple[str, ...]:
    """Repeated flags and comma lists alike: ["a,b", "c"] -> ("a", "b", "c")."""
    out: list[str] = []
    for value in values or ():
        out.extend(part.strip() for part in value.split(",") if part.strip())
    return tuple(out)
