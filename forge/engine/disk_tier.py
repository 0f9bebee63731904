"""The disk tier under the prefix cache (--kv-cache-dir): full blocks the cache forgets are written to
files (forge.engine.block_files), and a prompt that misses in RAM loads its next blocks from them.

    allocator (its caller's thread)        writer thread                reader thread
    evicted(block)  -- copy K/V -->        queue (bounded; full: dropped, counted) -> file
    fetch(seq)      -- blocks taken -->                                  file -> K/V of those blocks
    collect()       <-- loaded blocks join the prefix cache, held for their sequence until it is admitted

The sequence waits (the allocator does not admit it) while its blocks load; running sequences step on.
A block is read into blocks nobody else holds, so no forward touches them meanwhile. Files live in
DIR/<fingerprint>/ (block_files.fingerprint: another model's or layout's directory is never read),
guarded by an exclusive lock (a second process on it goes without the tier). The index (key -> size,
least recently used first) is rebuilt at start from the names and sizes in the directory, no file
read; the directory never holds more than `max_bytes`. A failed write (a full or read-only disk) turns
the tier off with one warning; a torn or corrupt file is a miss (and is deleted).
"""

from __future__ import annotations

import fcntl
import os
import queue
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from forge.engine import block_files as bf
from forge.engine.block_table import BlockId, SeqId, block_hash

PIN_STEPS = 64                # allocations a loaded block stays held for a sequence that is not admitted
WRITE_QUEUE_BYTES = 64 << 20  # evicted blocks waiting for the writer, at most


def _stderr(message: str) -> None:
    print(f"forge: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class DiskTierStats:
    """The tier's counts since start (blocks and bytes), and what the directory holds now."""
    enabled: bool
    hit_blocks: int = 0        # blocks loaded for prompts
    miss_blocks: int = 0       # full prompt blocks found neither in RAM nor on disk
    bad_files: int = 0         # files that failed their checks (deleted; each a miss)
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    writes_dropped: int = 0    # evicted blocks not written: the writer's queue was full
    files: int = 0
    bytes_on_disk: int = 0


@dataclass(slots=True)
class _Load:
    seq: SeqId
    blocks: list[BlockId]
    parts: list[tuple[int, int | None, tuple[int, ...], bytes]]   # (chain hash, parent hash, tokens, key) each
    num_ok: int = -1           # leading blocks read and checked; -1 while loading
    seconds: float = 0.0


@dataclass(slots=True)
class _Counts:
    hit_blocks: int = 0
    miss_blocks: int = 0
    bad_files: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    writes_dropped: int = 0
    read_seconds: list[float] = field(default_factory=list)   # one per load, until taken


class DiskTier:
    """Made by open(); the allocator calls evicted/collect/fetch/admitted (forge.engine.block_table.LowerTier)
    from one thread; its own two threads read and write files."""

    def __init__(self, directory: Path, fingerprint: bytes, max_bytes: int, arrays: list[npt.NDArray[Any]],
                 block_size: int, lock_fd: int, warn: Callable[[str], None]) -> None:
        self.directory = directory
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.block_size = block_size
        self._arrays = arrays            # the K/V cache's arrays, each [num_layers, num_blocks, ...]
        self.payload_len = sum(a[:, 0].nbytes for a in arrays)
        self.file_bytes = bf.file_size(block_size, self.payload_len)
        self._lock_fd = lock_fd
        self._warn = warn
        self.enabled = True
        self._lock = threading.Lock()    # the index and the counts
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        self.counts = _Counts()
        self._loads: dict[SeqId, _Load] = {}          # the allocator's side: loads in flight
        self._done: list[_Load] = []                  # finished by the reader, not yet collected
        self._pins: dict[SeqId, tuple[int, list[BlockId]]] = {}   # loaded blocks held for a sequence
        self._num_steps = 0
        self._wake = threading.Event()
        self._writes: queue.Queue[tuple[bytes, tuple[int, ...], npt.NDArray[np.uint8]] | None] = queue.Queue(
            max(4, WRITE_QUEUE_BYTES // max(1, self.payload_len)))
        self._reads: queue.Queue[_Load | None] = queue.Queue()
        self._rebuild_index()
        self._threads = [threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True),
                         threading.Thread(target=self._read_loop, name="kv-disk-reader", daemon=True)]
        for thread in self._threads:
            thread.start()

    @classmethod
    def open(cls, root: str, fingerprint: bytes, max_bytes: int, arrays: list[npt.NDArray[Any]], block_size: int,
             *, warn: Callable[[str], None] = _stderr) -> DiskTier | None:
        """The tier over ROOT/<fingerprint>/, or None (after one warning) when that directory cannot be made
        or locked: serving goes on without it."""
        directory = Path(root) / fingerprint.hex()
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            warn(f"the K/V disk tier is off: cannot use {directory}: {exc.strerror or exc}")
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            warn(f"the K/V disk tier is off: {directory} is in use by another forge process")
            return None
        return cls(directory, fingerprint, max_bytes, arrays, block_size, fd, warn)

    # ---- the allocator's side ----------------------------------------------------------------

    def evicted(self, block: BlockId, key: bytes, token_ids: tuple[int, ...]) -> None:
        """The prefix cache forgets `block`: its K/V are copied now (the block is reused in the next step)
        and written by the writer thread, unless the file exists or the writer is behind."""
        if not self.enabled or not key or self.file_bytes > self.max_bytes:
            return
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return
            if self._writes.full():
                self.counts.writes_dropped += 1
                return
        self._writes.put_nowait((key, token_ids, self._pack(block)))

    def collect(self, alloc: Any) -> None:
        """Blocks loaded since the last call join the prefix cache, held (reference 1) for their sequence
        until it is admitted, or PIN_STEPS allocations pass; a block that failed its read goes back."""
        self._num_steps += 1
        with self._lock:
            done, self._done = self._done, []
        for load in done:
            self._loads.pop(load.seq, None)
            kept = []
            for i, (block, (h, parent, chunk, key)) in enumerate(zip(load.blocks, load.parts, strict=True)):
                if i < load.num_ok and alloc.adopt(block, h, chunk, key, parent):
                    kept.append(block)
                else:
                    alloc.release(block)
            self._pins[load.seq] = (self._num_steps, kept)
        for seq, (step, _) in list(self._pins.items()):
            if self._num_steps - step > PIN_STEPS:
                self._unpin(alloc, seq)

    def fetch(self, alloc: Any, seq: SeqId, token_ids: tuple[int, ...], cache_salt: str | None) -> bool:
        """True while `seq`'s blocks are loading; starts loading the full prompt blocks past those cached in
        RAM that the disk holds (as many as there are free blocks for)."""
        if seq in self._loads:
            return True
        if not self.enabled or not self._index:
            return False
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        num, parent, key = alloc.cached_prefix(token_ids[:max_blocks * bs], cache_salt)
        parts = []
        with self._lock:
            for i in range(num, max_blocks):
                chunk = tuple(token_ids[i * bs:(i + 1) * bs])
                h, key = block_hash(parent, chunk), bf.chain_key(key, chunk)
                if key not in self._index:
                    break
                parts.append((h, parent, chunk, key))
                parent = h
        parts = parts[:alloc.free_blocks()]
        if not parts:
            return False
        load = _Load(seq, alloc.take_blocks(len(parts)), parts)
        self._loads[seq] = load
        self._reads.put(load)
        return True

    def admitted(self, alloc: Any, seq: SeqId, num_cached: int, num_tokens: int) -> None:
        """`seq` holds its blocks now: the loads' hold on them ends. Its full prompt blocks found in neither
        tier count as disk misses."""
        self._unpin(alloc, seq)
        self.counts.miss_blocks += max(0, (num_tokens - 1) // self.block_size - num_cached // self.block_size)

    def loading(self) -> bool:
        return bool(self._loads)

    def wait_loads(self, timeout: float) -> None:
        """Block until a load finishes (or `timeout` seconds): what a caller with nothing else to run does."""
        with self._lock:
            if self._done:
                return
        self._wake.wait(timeout)
        self._wake.clear()

    def _unpin(self, alloc: Any, seq: SeqId) -> None:
        for block in self._pins.pop(seq, (0, []))[1]:
            alloc.release(block)

    # ---- drain, stats, close -----------------------------------------------------------------

    def write_out(self, alloc: Any, *, budget_s: float = 60.0) -> int:
        """Write every block the prefix cache holds that the disk does not, most recently used first, within
        `budget_s` seconds: at unload and drain, when no step runs. Returns the blocks written."""
        deadline, num = time.monotonic() + budget_s, 0
        for block, key, chunk in alloc.cached_blocks():
            if not self.enabled or time.monotonic() > deadline:
                break
            with self._lock:
                if not key or key in self._index:
                    continue
            num += self._write(key, chunk, self._pack(block))
        return num

    def close(self) -> None:
        """Finish the writes queued, stop the threads, release the directory."""
        self._writes.put(None)
        self._reads.put(None)
        for thread in self._threads:
            thread.join()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def stats(self) -> DiskTierStats:
        c = self.counts
        with self._lock:
            return DiskTierStats(enabled=self.enabled, hit_blocks=c.hit_blocks, miss_blocks=c.miss_blocks,
                                 bad_files=c.bad_files, bytes_read=c.bytes_read, bytes_written=c.bytes_written,
                                 blocks_written=c.blocks_written, writes_dropped=c.writes_dropped,
                                 files=len(self._index), bytes_on_disk=self._bytes)

    def take_read_seconds(self) -> list[float]:
        """Each load's seconds since the last call (a latency histogram's observations)."""
        with self._lock:
            out, self.counts.read_seconds = self.counts.read_seconds, []
        return out

    def drop_all(self) -> int:
        """Delete every block file; returns how many."""
        with self._lock:
            keys, self._index, self._bytes = list(self._index), OrderedDict(), 0
        for key in keys:
            (self.directory / bf.file_name(key)).unlink(missing_ok=True)
        return len(keys)

    # ---- files -------------------------------------------------------------------------------

    def _rebuild_index(self) -> None:
        """The index from the directory's names and sizes, oldest first (by modification time); leftover
        temporary files and files of the wrong size are deleted, and the total trimmed to max_bytes."""
        found = []
        with os.scandir(self.directory) as it:
            for entry in it:
                key = bf.key_of(entry.name)
                st = entry.stat()
                if key is not None and st.st_size == self.file_bytes:
                    found.append((st.st_mtime_ns, key, st.st_size))
                elif entry.name.endswith(".tmp") or key is not None:
                    Path(entry.path).unlink(missing_ok=True)
        found.sort()
        with self._lock:
            self._index = OrderedDict((key, size) for _, key, size in found)
            self._bytes = sum(size for _, _, size in found)
            self._trim(0)

    def _trim(self, room: int) -> None:
        """Delete the least recently used files until `room` more bytes fit (under the lock)."""
        while self._index and self._bytes + room > self.max_bytes:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            (self.directory / bf.file_name(key)).unlink(missing_ok=True)

    def _write(self, key: bytes, token_ids: tuple[int, ...], payload: npt.NDArray[np.uint8]) -> int:
        """Write one block's file; 1 if written. A failure turns the tier off."""
        with self._lock:
            if not self.enabled or key in self._index:
                return 0
            self._trim(self.file_bytes)
        try:
            size = bf.write_block(self.directory, self.fingerprint, key, token_ids, payload.data)
        except OSError as exc:
            self._fail(f"cannot write {self.directory}: {exc.strerror or exc}")
            return 0
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self._bytes += size
            self.counts.bytes_written += size
            self.counts.blocks_written += 1
            self._trim(0)
        return 1

    def _fail(self, reason: str) -> None:
        with self._lock:
            was, self.enabled = self.enabled, False
        if was:
            self._warn(f"the K/V disk tier is off: {reason}; serving goes on without it")

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            self._write(*item)

    def _read_loop(self) -> None:
        while (load := self._reads.get()) is not None:
            started, num_ok = time.perf_counter(), 0
            for block, (_, _, chunk, key) in zip(load.blocks, load.parts, strict=True):
                if not self._read_into(block, key, chunk):
                    break
                num_ok += 1
            load.num_ok, load.seconds = num_ok, time.perf_counter() - started
            with self._lock:
                self._done.append(load)
                self.counts.hit_blocks += num_ok
                self.counts.read_seconds.append(load.seconds)
            self._wake.set()

    def _read_into(self, block: BlockId, key: bytes, chunk: tuple[int, ...]) -> bool:
        path = self.directory / bf.file_name(key)
        try:
            payload = bf.read_block(path, self.fingerprint, key, chunk, self.payload_len)
        except OSError:
            payload = None
        with self._lock:
            if payload is None:
                if self._index.pop(key, None) is not None:
                    self._bytes -= self.file_bytes
                    self.counts.bad_files += 1
                path.unlink(missing_ok=True)
                return False
            if key in self._index:
                self._index.move_to_end(key)
            self.counts.bytes_read += len(payload)
        self._unpack(block, payload)
        return True

    def _pack(self, block: BlockId) -> npt.NDArray[np.uint8]:
        """A copy of `block`'s K/V, every array's in turn, as bytes."""
        out = np.empty(self.payload_len, np.uint8)
        offset = 0
        for a in self._arrays:
            part = a[:, block]
            out[offset:offset + part.nbytes].view(a.dtype).reshape(part.shape)[...] = part
            offset += part.nbytes
        return out

    def _unpack(self, block: BlockId, payload: memoryview) -> None:
        offset = 0
        for a in self._arrays:
            dst = a[:, block]
            dst[...] = np.frombuffer(payload, a.dtype, dst.size, offset).reshape(dst.shape)
            offset += dst.nbytes
