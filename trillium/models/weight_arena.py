"""A CPU model's weights in one arena of memory, advised for 2 MB (transparent huge) pages.

    pack(model) -> ArenaReport | None      after loading, before the first forward
    huge_page_zeros(shape, dtype) -> Tensor a zeroed CPU tensor on 2 MB pages (the KV caches: kv_cache.py)

The idea: a decode step at small batch reads every weight once, in order, and
is bound by how fast those bytes stream from memory. Tensors allocated one by
one sit on 4 KB pages wherever the heap put them; on the 2-core AMD EPYC we
benchmark on (THP `madvise`, so nothing gets huge pages unless asked) the
bench model's 33 linears of a batch-1 step read their 110 MB at 23.3-23.9
GB/s that way, and at 24.9-25.6 GB/s from one arena on 2 MB pages (a decode
step 1.01-1.10x faster), interleaved in one process (bench/weight_arena.py).
WHY both: the hardware prefetcher stops at each 4 KB page boundary and every
4 KB costs a TLB entry; one contiguous range in layer order also lets one
weight's stream run into the next. llama.cpp gets the same from its
memory-mapped GGUF (the kernel maps the file's page cache with 2 MB folios
where it can).

What moves: every parameter, and every buffer, of the model that owns its
whole storage (contiguous, not shared with another tensor), each 64-byte
aligned, in the order the module tree lists them (layer by layer): the
parameters in one arena, the buffers (a GGUF layer's packed blocks, the rope
table) in another. A parameter keeps its identity (`param.data` is swapped, as
sleep does: executor/memory.py); a buffer has its storage swapped in place
(`set_`), so every module and graph holding it sees the arena. Values are
copied bit-exactly. A weight update writes into the arena views in place
(a distributed one copies its shadow in on the CPU: executor/shadow_weights.py);
sleep level 2 drops the parameters (their arena goes with the last view) and
the refill after it packs them again.

Huge pages are advice (`madvise(MADV_HUGEPAGE)` on the 2 MB-aligned range,
before the first touch): with THP `never`, or on a system without it, the
arena is plain 4 KB pages and the log says so. The report counts what the
kernel actually gave (`AnonHugePages` of the range, /proc/self/smaps).
Memory: the arena is filled tensor by tensor and each old storage is freed
as soon as its tensor moved (and the heap trimmed after), so the peak is the
weights plus one tensor (plus up to 4 MB of alignment).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import sys

import attrs
import torch

from trillium.kernels import onednn_packed

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
    params = list(model.named_parameters(remove_duplicate=False))
    named_buffers = list(model.named_buffers(remove_duplicate=False))
    users = _storage_users([*params, *named_buffers])
    groups = [_movable(params, users)]
    if buffers:
        groups.append(_movable(named_buffers, users))
    thp_mode = _thp_mode()
    num_tensors = arena_bytes = huge_bytes = 0
    for tensors in groups:
        if tensors:
            total, huge = _pack(tensors)
            num_tensors, arena_bytes, huge_bytes = num_tensors + len(tensors), arena_bytes + total, huge_bytes + huge
    if not num_tensors:
        return None
    onednn_packed.forget()  # made from the storage the weights just left
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
    raw, start = _huge_page_block(total)
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
    trim_host_heap()  # the old storages of tensors below the mmap threshold went back to the heap
    return total, min(total, _huge_bytes(raw.data_ptr() + start))


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in a mapping of its own whose whole 2 MB pages are advised for huge pages
    (below 2 MB: torch.zeros).

    WHY for the KV caches: a decode step's attention streams each sequence's blocks as the linears
    stream the weights; on 4 KB pages every page is a TLB entry and a stop for the prefetcher. On
    the 2-core AMD EPYC we benchmark on, the bench model's attention over 400 keys a row (8
    layers, 2 threads, the same kernel on both alternately: bench/paged_decode_attention.py
    --kv-pages) ran 1.06-1.09x (1 row), 1.03-1.10x (16) and 1.06-1.08x (64 rows) faster from
    caches on 2 MB pages. No memory is added: the zeros touch every page of the tensor either way,
    only the 2 MB pages it fills are advised (its tail stays on 4 KB pages), and the alignment
    slack around it is never touched.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    raw, start = _huge_page_block(nbytes, whole_pages_only=True)
    tensor = raw[start:start + nbytes].view(dtype).view(shape)
    tensor.zero_()
    return tensor


def _huge_page_block(nbytes: int, *, whole_pages_only: bool = False) -> tuple[torch.Tensor, int]:
    """A uint8 block over a private anonymous mapping of its own, holding a 2 MB-aligned range of
    `nbytes` advised for huge pages before any page of it exists: (the block, where the range starts
    in it). The range's last partial 2 MB page is advised too unless `whole_pages_only`.

    WHY a mapping of its own (not torch.empty): glibc serves allocations below its mmap threshold,
    which rises to 32 MB once a large block is freed, from the heap, where pages may already exist
    (the advice would not apply) and the advice would outlive the tensor (later small allocations
    there faulting in 2 MB pages). The mapping is unmapped with the block's last view."""
    span = _round_up(nbytes, HUGE_PAGE_BYTES)
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # not a POSIX system: torch's allocator, 4 KB pages
        return torch.empty(span + HUGE_PAGE_BYTES, dtype=torch.uint8), 0
    block = mmap.mmap(-1, span + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(block, dtype=torch.uint8)  # holds the mapping while any view lives
    start = _round_up(raw.data_ptr(), HUGE_PAGE_BYTES) - raw.data_ptr()
    advised = nbytes - nbytes % HUGE_PAGE_BYTES if whole_pages_only else span
    if advised:
        _advise_huge_pages(raw.data_ptr() + start, advised)
    return raw, start


def _storage_users(named) -> dict[int, int]:
    """Storage address -> how many distinct tensors (parameters and buffers together) use it."""
    users: dict[int, int] = {}
    for tensor in {id(t): t for _, t in named}.values():
        if tensor.device.type == "cpu" and tensor.numel() > 0 and not tensor.is_sparse:
            key = tensor.untyped_storage().data_ptr()
            users[key] = users.get(key, 0) + 1
    return users


def _movable(named, users: dict[int, int]) -> list[torch.Tensor]:
    """Of `named` (name, tensor) pairs, the tensors that own their whole storage on the CPU (no other
    parameter or buffer uses it: views of each other stay where they are, together), in order, each
    once (a tied weight is one tensor under two names)."""
    distinct = {id(tensor): tensor for _, tensor in named}
    return [t for t in distinct.values() if t.device.type == "cpu" and t.numel() > 0 and not t.is_sparse
            and users[t.untyped_storage().data_ptr()] == 1 and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()]


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
            log.info("madvise(MADV_HUGEPAGE) failed (errno %d): 4 KB pages",
                     ctypes.get_errno())
    except (OSError, AttributeError):
        pass  # no libc madvise: 4 KB pages


def trim_host_heap() -> None:
    """glibc's malloc_trim(0): free heap pages back to the OS (also executor/memory.py's, at sleep)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim


def smaps_field(address: int, key: str) -> list[str] | None:
    """The values of `key` ("AnonHugePages:", "VmFlags:") in the /proc/self/smaps entry of the mapping
    holding `address`; None where there is no such mapping, field or file."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                fields = line.split()
                if not fields:
                    continue
                if "-" in fields[0] and not fields[0].endswith(":"):
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    inside = lo <= address < hi
                elif inside and fields[0] == key:
                    return fields[1:]
    except (OSError, ValueError):
        pass
    return None


def _huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, 0 where unknown."""
    values = smaps_field(address, "AnonHugePages:")
    return int(values[0]) * 1024 if values else 0
