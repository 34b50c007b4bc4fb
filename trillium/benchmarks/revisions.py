"""A C kernel as it was at an earlier git revision, built beside today's: a benchmark's baseline column.

    library_at(module, rev) -> CLibrary     module: a kernels module with _SOURCE, _declare and _LIBRARY
    using(module, library)                  context manager: the module's calls run that build meanwhile

Used by `bench/dense_linear.py --against REV` and `bench/paged_decode_attention.py --against REV` to
time a kernel change old against new in one run (alternated rounds, same inputs). The old source is
read with `git show REV:<path>` from the checkout this package runs from, written to a temporary
directory and built with today's flags, so it needs git and a checkout (not an installed wheel);
the function signatures (`_declare`) must not have changed in between.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from pathlib import Path
from types import ModuleType

from trillium.kernels.c_library import CLibrary


def library_at(module: ModuleType, rev: str) -> CLibrary:
    source: Path = module._SOURCE
    try:
        root = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=source.parent, capture_output=True,
                              text=True, check=True).stdout.strip()
        text = subprocess.run(["git", "show", f"{rev}:{source.relative_to(root).as_posix()}"], cwd=root,
                              capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise SystemExit(f"--against {rev}: cannot read {source.name} at that revision: {detail.strip()}") from None
    old = Path(tempfile.mkdtemp(prefix="trillium-kernel-")) / source.name
    old.write_text(text)
    return CLibrary(old, f"{source.name} at {rev}", module._declare, flags=module._LIBRARY.flags,
                    fallback="no baseline column")


@contextlib.contextmanager
def using(module: ModuleType, library: CLibrary):
    saved = module._LIBRARY
    module._LIBRARY = library
    try:
        yield
    finally:
        module._LIBRARY = saved
