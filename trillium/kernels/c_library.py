"""The C kernels' build: compile a kernel source once per machine, load it with ctypes.

    CLibrary(source, what, declare).get() -> ctypes.CDLL | None   (None: no compiler, or the build failed)
    .available() -> bool, .unavailable_reason() -> str | None     (why get() is None; logged once)
    CLibrary(..., compilers=CXX, flags=(...), fallback="...")   another compiler / flags (native_ops.py:
                                                                 C++ against torch's headers)

Used by gguf_cpu.py, int4_cpu.py, dense_cpu.py and paged_attention_cpu.py. Each source is compiled with the same
flags (`-O3 -march=native -fopenmp`, shared), at first use, into
`local_cache.cache_dir()/kernels/<name>-<key>.so`, keyed by the source, the
flags, the compiler and this CPU's flags, so a changed kernel or another
machine builds anew and nothing is downloaded. WHY a temporary name and a
rename: several executors (tensor-parallel ranks, data-parallel replicas)
may build the same library at once; the rename is atomic.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11")
CC = ("cc", "gcc", "clang")  # the C compilers tried, in order
CXX = ("c++", "g++", "clang++")


def cpu_flags() -> str:
    """/proc/cpuinfo's flags line (part of a built library's cache key)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"), or "" where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


class CLibrary:
    """One kernel source, built and loaded at the first `get()`; `declare` sets its
    functions' ctypes signatures once loaded."""

    def __init__(self, source: Path, what: str, declare: Callable[[ctypes.CDLL], None], *,
                 compilers: tuple[str, ...] = CC, flags: tuple[str, ...] = FLAGS,
                 fallback: str = "its weights will be dequantized") -> None:
        self.source = source
        self.what = what  # for the log: "the GGUF CPU kernel"
        self._declare = declare
        self.compilers, self.flags = compilers, flags
        self.fallback = fallback  # for the log: what runs instead
        self._lib: ctypes.CDLL | None = None
        self.error: str | None = None

    def get(self) -> ctypes.CDLL | None:
        if self._lib is None and self.error is None:
            try:
                self._lib = self._build()
            except (RuntimeError, OSError) as exc:
                self.error = str(exc)
                log.warning("%s is unavailable (%s); %s", self.what, exc, self.fallback)
        return self._lib

    def available(self) -> bool:
        return self.get() is not None

    def unavailable_reason(self) -> str | None:
        self.get()
        return self.error

    def _path(self, compiler: str) -> Path:
        from trillium.local_cache import cache_dir

        key = hashlib.sha256()
        for part in (self.source.read_bytes(), " ".join(self.flags).encode(), compiler.encode(), cpu_flags().encode()):
            key.update(part)
        return cache_dir() / "kernels" / f"{self.source.stem}-{key.hexdigest()[:16]}.so"

    def _build(self) -> ctypes.CDLL:
        compiler = next((found for name in self.compilers if (found := shutil.which(name))), None)
        if compiler is None:
            raise RuntimeError(f"no compiler ({', '.join(self.compilers)}) on PATH")
        target = self._path(compiler)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            try:
                subprocess.run([compiler, *self.flags, str(self.source), "-o", tmp], check=True, capture_output=True,
                               text=True)
                os.replace(tmp, target)
            except subprocess.CalledProcessError as exc:
                raise RuntimeError(f"{compiler} failed on {self.source.name}: {exc.stderr.strip()[:500]}") from None
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            log.info("built %s: %s", self.what, target)
        lib = ctypes.CDLL(str(target))
        self._declare(lib)
        return lib


__all__ = ["CC", "CXX", "FLAGS", "CLibrary", "cpu_flags", "cpu_vendor"]
