"""The disk KV tier's files: one per block, written and read off the step.

Role: the executor side of the disk tier (the scheduler's index is
actors/kv_tiers/disk.py). A step's disk operations arrive in its
`ExecuteBatch` and run first, in order, before the host copies:

    WRITE   copy host slot -> bytes now (a save of this step may reuse the
            slot), then the file is written by the I/O thread
    WRITE_DEVICE  the same from a device block (still intact: nothing of
            this step has written the cache yet)
    READ    the I/O thread reads and verifies the file, then fills the host
            slot; the slot is reported in a later BatchResult
    DELETE  the I/O thread removes the file
    CLEAR   the I/O thread removes every file; later ones go to a new directory

One I/O thread runs them in arrival order, so a READ always sees the WRITE
queued before it and a DELETE never races a WRITE of the same file. Reads
release the GIL (file I/O, hashing, copies), so the step goes on meanwhile.

File format (little-endian):

    b"TRKVBLK1" | u32 header length | header JSON | payload
    header: {"hash": block hash hex, "layout": cache layout, "size": payload
             bytes, "sha256": payload digest}

The layout names every per-block tensor's shape and dtype and, for an fp8
cache, the layers' scales: a block is only read into a cache that would
interpret its bytes the same way. A file that is short, corrupt (digest),
foreign (hash, layout) or unreadable fails its read and is deleted: the
scheduler then recomputes those tokens. Files are written to a temporary
name and renamed, so a crash mid-write leaves no half file under a hash.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import struct
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from trillium.actors.kv_tiers.disk import FILE_SUFFIX, DiskOp, block_file

log = logging.getLogger(__name__)

MAGIC = b"TRKVBLK1"
_HEADER_LEN = struct.Struct("<I")


def encode_block(block_hash: bytes, layout: str, payload: bytes) -> bytes:
    header = json.dumps({"hash": block_hash.hex(), "layout": layout, "size": len(payload),
                         "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    return MAGIC + _HEADER_LEN.pack(len(header)) + header + payload


def decode_block(data: bytes | bytearray, block_hash: bytes, layout: str) -> memoryview:
    """The payload of a block file's bytes; ValueError if it is not this block, intact."""
    if data[: len(MAGIC)] != MAGIC:
        raise ValueError("not a block file")
    start = len(MAGIC) + _HEADER_LEN.size
    if len(data) < start:
        raise ValueError("truncated header")
    (header_len,) = _HEADER_LEN.unpack_from(data, len(MAGIC))
    header = json.loads(bytes(data[start : start + header_len]))
    payload = memoryview(data)[start + header_len :]
    if header.get("hash") != block_hash.hex():
        raise ValueError("holds another block")
    if header.get("layout") != layout:
        raise ValueError("written for another cache layout")
    if len(payload) != header.get("size"):
        raise ValueError(f"truncated: {len(payload)} of {header.get('size')} payload bytes")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError("content digest mismatch")
    return payload


class DiskKvStore:
    """Block files under one directory, read into / written from a HostKvStore."""

    def __init__(self, host_kv, directory: str, roots: tuple[str, str] | None = None) -> None:
        self.host_kv = host_kv
        self.directory = directory
        # Under TP: (the scheduler's root, this rank's root); a CLEAR names the scheduler's
        # (rank 0's) new directory, which this rank keeps under its own root.
        self._roots = roots
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trillium-kv-disk")
        self._done: queue.SimpleQueue[tuple[int, bool]] = queue.SimpleQueue()
        self.num_in_flight = 0  # READs not yet reported
        self._layout_key: weakref.ref | None = None
        self._layout: str | None = None
        self._io.submit(self._prepare, directory)
        log.info("disk KV tier: %s", directory)

    def close(self) -> None:
        """Finish the queued writes (so a restart finds them), then stop the thread."""
        self._io.shutdown(wait=True)

    # -- one step (on the torch thread) ------------------------------------

    def apply(self, kv_caches, ops: np.ndarray, slots: np.ndarray, hashes) -> None:
        layout = self.layout(kv_caches)
        for op, slot, block_hash in zip(ops.tolist(), slots.tolist(), hashes):
            if op == DiskOp.WRITE:
                if layout is not None:  # an uncalibrated fp8 cache has written nothing valid
                    self._io.submit(self._write, self.directory, block_hash, layout, self.host_kv.slot_bytes(slot))
            elif op == DiskOp.WRITE_DEVICE:
                if layout is not None:
                    payload = self.host_kv.device_block_bytes(kv_caches, slot)
                    self._io.submit(self._write, self.directory, block_hash, layout, payload)
            elif op == DiskOp.READ:
                self.num_in_flight += 1
                if layout is None:
                    self._done.put((slot, False))
                else:
                    self._io.submit(self._read, self.directory, block_hash, slot, layout)
            elif op == DiskOp.DELETE:
                self._io.submit(_remove, block_file(self.directory, block_hash))
            elif op == DiskOp.CLEAR:
                self._io.submit(self._clear, self.directory)
                self.directory = self._own(block_hash.decode())
                self._io.submit(os.makedirs, self.directory, exist_ok=True)
            else:
                raise ValueError(f"unknown disk KV operation {op}")

    def _own(self, directory: str) -> str:
        if self._roots is None:
            return directory
        theirs, mine = self._roots
        return os.path.join(mine, os.path.relpath(directory, theirs))

    def completions(self, wait_s: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """Host slots whose READ finished since the last call: (good, failed).
        With `wait_s`, wait that long for a first one if reads are in flight."""
        done = []
        if wait_s > 0 and self.num_in_flight and self._done.empty():
            try:
                done.append(self._done.get(timeout=wait_s))
            except queue.Empty:
                pass
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.num_in_flight -= len(done)
        good = np.fromiter((s for s, ok in done if ok), np.int32)
        failed = np.fromiter((s for s, ok in done if not ok), np.int32)
        return good, failed

    def layout(self, kv_caches) -> str | None:
        """The cache layout a block file must match; None while an fp8 cache is uncalibrated."""
        # WHY a weak reference as the key: sleep and wake replace the caches (and
        # may give the new list the old one's id); the fp8 scales then change.
        if self._layout_key is not None and self._layout_key() is kv_caches[0]:
            return self._layout
        parts = [[list(t.shape[1:]), str(t.dtype)] for t in self.host_kv.host]
        scales = []
        for layer in kv_caches:
            k_scale = getattr(layer, "k_scale", None)
            if k_scale is None:
                continue
            if not layer.calibrated:
                return None  # not cached: calibration comes with the first write
            scales.append([float(k_scale), float(layer.v_scale)])
        layout = json.dumps({"tensors": parts, "scales": scales}, separators=(",", ":"))
        self._layout_key, self._layout = weakref.ref(kv_caches[0]), layout
        return layout

    # -- on the I/O thread ----------------------------------------------------

    def _prepare(self, directory: str) -> None:
        """Create the directory; drop other weight versions' blocks of this model
        (blocks of updated weights no checkpoint load will ever reproduce)."""
        os.makedirs(directory, exist_ok=True)
        parent, own = os.path.split(os.path.normpath(directory))
        for entry in os.scandir(parent):
            if entry.is_dir() and entry.name != own and entry.name.startswith("w-"):
                shutil.rmtree(entry.path, ignore_errors=True)

    def _write(self, directory: str, block_hash: bytes, layout: str, payload: bytes) -> None:
        path = block_file(directory, block_hash)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(encode_block(block_hash, layout, payload))
            os.replace(tmp, path)
        except OSError as exc:  # disk full, directory gone: the block just misses later
            log.warning("disk KV tier: cannot write %s: %s", path, exc)
            _remove(tmp)

    def _read(self, directory: str, block_hash: bytes, slot: int, layout: str) -> None:
        path = block_file(directory, block_hash)
        ok = False
        try:
            started = time.perf_counter()
            with open(path, "rb") as f:
                # WHY a bytearray: torch.frombuffer wants a writable buffer
                data = bytearray(os.fstat(f.fileno()).st_size)
                num = f.readinto(data)
                if num < len(data):
                    del data[num:]
            self.host_kv.write_slot(slot, decode_block(data, block_hash, layout))
            ok = True
            log.debug("disk KV tier: read %s in %.1f ms", path, 1e3 * (time.perf_counter() - started))
        except (OSError, ValueError) as exc:
            log.warning("disk KV tier: ignoring block file %s: %s", path, exc)
            _remove(path)
        except Exception:  # never leave a READ unanswered: the request would wait forever
            log.exception("disk KV tier: reading %s failed", path)
            _remove(path)
        finally:
            self._done.put((slot, ok))

    def _clear(self, directory: str) -> None:
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            return
        for entry in entries:
            if entry.name.endswith(FILE_SUFFIX) or entry.name.endswith(".tmp"):
                _remove(entry.path)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("disk KV tier: cannot remove %s: %s", path, exc)
