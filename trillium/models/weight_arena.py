"""A CPU model's weights in one arena of memory, advised for 2 MB (transparent huge) pages.

    pack(model) -> ArenaReport | None      after loading, before the first forward

The idea: a decode step at small batch reads every weight once, in order, and
is bound by how fast those bytes stream from memory. Tensors allocated one by
one sit on 4 KB pages wherever the heap put them; on the 2-core AMD EPYC we
benchmark on (THP `madvise`, so nothing gets huge pages unless asked) the
bench model's 33 linears of a batch-1 step read their 110 MB at 20.7-22.6
GB/s that way, and at 22.6-24.2 GB/s from one arena on 2 MB pages, interleaved
in one process (bench/weight_arena.py). WHY both: the hardware prefetcher
stops at each 4 KB page boundary and every 4 KB costs a TLB entry; one
contiguous range in layer order also lets one weight's stream run into the
next. llama.cpp gets the same from its memory-mapped GGUF (the kernel maps
the file's page cache with 2 MB folios where it can).

What moves: every parameter, and every buffer, of the model that owns its
whole storage (contiguous, not shared with another tensor), each 64-byte
aligned, in the order the module tree lists them (layer by layer): the
parameters in one arena, the buffers (a GGUF layer's packed blocks, the rope
table) in another. A parameter keeps its identity (`param.data` is swapped, as
sleep does: executor/memory.py); a buffer has its storage swapped in place
(`set_`), so every module and graph holding it sees the arena. Values are
copied bit-exactly. A weight update writes into the arena views in place;
sleep level 2 drops the parameters (their arena goes with the last view) and
the refill after it packs them again.

Huge pages are advice (`madvise(MADV_HUGEPAGE)` on the 2 MB-aligned range,
before the first touch): with THP `never`, or on a system without it, the
arena is plain 4 KB pages and the log says so. The report counts what the
kernel actually gave (`AnonHugePages` of the range, /proc/self/smaps).
Memory: the arena is filled tensor by tensor and each old storage is freed
as soon as its tensor moved, so the peak is the weights plus one tensor
(plus up to 4 MB of alignment).
"""

from __future__ import annotations

import ctypes
import logging
import sys

import attrs
import torch

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
ALIGN_BYTES = 64  # each tensor's start: a cache line (and any SIMD load width)
MADV_HUGEPAGE = 14  # <linux/mman.h>
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


@attrs.frozen
class ArenaReport:
    num_tensors: int
    arena_bytes: int
    huge_page_bytes: int  # of the arena, backed by huge pages (smaps), 0 where unknown
    thp_mode: str  # the kernel's THP setting ("always", "madvise", "never"; "" where there is none)


def pack(model: torch.nn.Module, *, buffers: bool = True) -> ArenaReport | None:
    """Move the model's CPU parameters into one huge-page-advised arena and (`buffers`) its buffers
    into another; None (nothing done) off the CPU or for a model with nothing that can move.
    WHY two arenas: sleep level 2 drops the parameters only (executor/memory.py), and a buffer
    (a GGUF layer's packed blocks, the rope table) sharing their arena would keep it all alive."""
    groups = [_movable(model.named_parameters(remove_duplicate=False))]
    if buffers:
        groups.append(_movable(model.named_buffers(remove_duplicate=False)))
    thp_mode = _thp_mode()
    num_tensors = arena_bytes = huge_bytes = 0
    for tensors in groups:
        if tensors:
            total, huge = _pack(tensors)
            num_tensors, arena_bytes, huge_bytes = num_tensors + len(tensors), arena_bytes + total, huge_bytes + huge
    if not num_tensors:
        return None
    report = ArenaReport(num_tensors, arena_bytes, huge_bytes, thp_mode)
    log.info("weights: %d tensors, %.1f MB in %d arena(s), %.1f MB of them on 2 MB pages (THP %s)",
             num_tensors, arena_bytes / 1e6, sum(map(bool, groups)), huge_bytes / 1e6, thp_mode or "absent")
    return report


def _pack(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """Move `tensors` into one new arena, in order: (its bytes, of them on huge pages)."""
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += _round_up(tensor.numel() * tensor.element_size(), ALIGN_BYTES)
    span = _round_up(total, HUGE_PAGE_BYTES)
    # WHY torch.empty: a large allocation is its own fresh mmap (untouched, so not yet resident),
    # freed by torch when the last view of it goes.
    raw = torch.empty(span + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = _round_up(raw.data_ptr(), HUGE_PAGE_BYTES) - raw.data_ptr()
    _advise_huge_pages(raw.data_ptr() + start, span)
    storage = raw.untyped_storage()
    with torch.no_grad():
        for tensor, offset in zip(tensors, offsets):
            base = start + offset
            view = raw[base:base + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            if isinstance(tensor, torch.nn.Parameter):
                tensor.data = view  # its old storage goes now, before the next tensor fills
            else:
                tensor.set_(storage, base // tensor.element_size(), tensor.shape, view.stride())
    return total, min(total, _huge_bytes(raw.data_ptr() + start))


def _movable(named) -> list[torch.Tensor]:
    """Of `named` (name, tensor) pairs, the tensors that own their whole storage on the CPU, in order,
    each once (a tied weight is one tensor under two names)."""
    distinct = {id(tensor): tensor for _, tensor in named}
    candidates = [t for t in distinct.values() if t.device.type == "cpu" and t.numel() > 0 and not t.is_sparse]
    users: dict[int, int] = {}
    for tensor in candidates:
        key = tensor.untyped_storage().data_ptr()
        users[key] = users.get(key, 0) + 1
    # two tensors on one storage (views of each other) stay where they are, together
    return [t for t in candidates if users[t.untyped_storage().data_ptr()] == 1 and t.is_contiguous()
            and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()]


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _thp_mode() -> str:
    try:
        with open(_THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return ""
    return next((w.strip("[]") for w in text.split() if w.startswith("[")), "")


def _advise_huge_pages(address: int, length: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(address, length, MADV_HUGEPAGE) != 0:
            log.info("madvise(MADV_HUGEPAGE) on the weight arena failed (errno %d): 4 KB pages",
                     ctypes.get_errno())
    except (OSError, AttributeError):
        pass  # no libc madvise: 4 KB pages


def _huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps), 0 where unknown."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0
