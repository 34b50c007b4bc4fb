"""A C kernel as it was at an earlier git revision, built beside today's: a benchmark's baseline column.

    library_at(module, rev) -> CLibrary     module: a kernels module with _SOURCE, _declare and _LIBRARY;
                                            built and loaded, or RuntimeError saying why not
    using(module, library)                  context manager: the module's calls run that build meanwhile

Used by `bench/dense_linear.py --against REV` and `bench/paged_decode_attention.py --against REV` to
time a kernel change old against new in one run (alternated rounds, same inputs). The old source is
read with `git show REV:<path>` from the checkout this package runs from, written under the kernel
cache (`local_cache.cache_dir()/kernels/revisions/<commit>/`) and built with today's flags, so it
needs git and a checkout (not an installed wheel); the function signatures (`_declare`) must not
have changed in between.
"""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from types import ModuleType

from trillium.kernels.c_library import CLibrary
from trillium.local_cache import cache_dir


def library_at(module: ModuleType, rev: str) -> CLibrary:
    source = Path(module._SOURCE).resolve()  # git answers with real paths: a symlinked checkout too

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=source.parent, capture_output=True, text=True, check=True).stdout

    try:
        root = Path(git("rev-parse", "--show-toplevel").strip()).resolve()
        commit = git("rev-parse", "--verify", f"{rev}^{{commit}}").strip()
        text = git("show", f"{commit}:{source.relative_to(root).as_posix()}")
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        raise RuntimeError(f"cannot read {source.name} at {rev}: {detail.strip()}") from None
    old = cache_dir() / "kernels" / "revisions" / commit / source.name
    old.parent.mkdir(parents=True, exist_ok=True)
    old.write_text(text)
    library = CLibrary(old, f"{source.name} at {rev}", module._declare, flags=module._LIBRARY.flags,
                       fallback="no baseline column")
    try:
        built = library.get()
    except AttributeError as exc:  # `_declare` names a function that revision does not have
        raise RuntimeError(f"{source.name} at {rev} lacks what today's declares: {exc}") from None
    if built is None:
        raise RuntimeError(f"{source.name} at {rev} did not build: {library.error}")
    return library


@contextlib.contextmanager
def using(module: ModuleType, library: CLibrary):
    saved = module._LIBRARY
    module._LIBRARY = library
    try:
        yield
    finally:
        module._LIBRARY = saved
