"""BlockStore: the disk tier of the cache. Content-addressed, checksummed, write-behind.

Layout of a store dir (folders 0700, files 0600, whatever the umask):
    index.json                   the files, their sizes and last use (`block_index`)
    blocks/<key[:2]>/<key>.kvb   one immutable block file each (`block_file` says what is inside)
    quarantine/                  the last few files that failed their checks, kept to inspect

A block's name is its key (`block_keys`), which hashes everything its K/V depend on, so a file
never changes once written: it is written to a temp name beside its final one, fsynced and renamed
into place, and two processes writing the same block race harmlessly to the same bytes.

The directory is the truth, the index a summary of it that spares start-up a stat per file:
opening reads index.json only; the writer thread then reconciles it with a listing of the block
folders (adopts files other processes wrote, drops entries whose files vanished, removes temp files
of writers that are no longer alive) before its first write. Several processes may share a dir.

`put` copies the block to the CPU at once (the pool slot may be reused when it returns) and
queues it; one background thread writes, so no disk time lands on the decode path. `get` reads and
verifies synchronously; a file that is missing, short or fails its checksum is a typed result,
never served, and a damaged one is moved to quarantine/. Over `budget_bytes`, the least recently
used files (by last put or get) are deleted, never one a `get` is reading.

torch is imported only by `block_file`'s functions that build or read tensors, and this module
imports it nowhere else: `read_disk_tier` (for `kvchat inspect`) is re-exported from here.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.cache.block_backend import ReadResult, ReadStatus, StoreStats
from kvchat.cache.block_file import BlockFileError, BlockLayout, read_block_bytes
from kvchat.cache.block_index import (
    BLOCK_INDEX,
    DiskTier,
    StoreIndex,
    block_path,
    read_disk_tier,
    read_index,
    scan_blocks,
)
from kvchat.cache.block_keys import is_key
from kvchat.cache.write_queue import Queued, Settle, WriteQueue
from kvchat.files import FILE_MODE, WriteError, atomic_write, private_dir

if TYPE_CHECKING:
    import torch

QUARANTINE_KEEP = 8  # damaged files kept for inspection; older ones are deleted

__all__ = ["BlockLayout", "BlockStore", "DiskTier", "ReadResult", "ReadStatus", "StoreStats",
           "read_disk_tier"]


class BlockStore:
    """The disk tier (see the module docstring). Thread-safe; `close` it (or use `with`) so the
    queue is written and the index saved. budget_bytes == 0 turns the store off: puts are
    dropped, gets miss, and the dir is never touched."""

    def __init__(self, root: Path, layout: BlockLayout, budget_bytes: int, *,
                 max_pending_bytes: int = 256 << 20, index_every_s: float = 5.0,
                 shared: bool = False) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.root = Path(root)
        self.shared = shared  # other instances write this folder too (`block_backend`)
        self.layout = layout
        self.budget_bytes = budget_bytes
        self.max_pending_bytes = max_pending_bytes
        self.index_every_s = index_every_s
        self._queue = WriteQueue(self._write, max_bytes=max_pending_bytes,
                                 name="kvchat-block-store", first=self._start,
                                 idle=(self._save_due, self._save_index))
        self._cond = self._queue.cond  # guards the state below
        self._counts = self._queue.counts
        self._index_lock = threading.Lock()  # orders index saves only
        self._index = StoreIndex()
        self._readers: Counter[str] = Counter()  # keys a get is reading: never evicted
        self._notices: list[str] = []
        self._last_save = time.monotonic()
        self._shards: set[str] = set()
        # the last block that could not be written, and why: what a failed save reports
        self.write_failure: tuple[Path, Exception] | None = None
        if not self.enabled:
            return
        private_dir(self.root, "the disk cache folder")
        loaded = read_index(self.root)
        if loaded is None and (self.root / BLOCK_INDEX).exists():
            self._notices.append(f"Disk cache index {self.root / BLOCK_INDEX} was unreadable; "
                                 "it is rebuilt from the block files.")
        self._index = StoreIndex.of(loaded[0] if loaded else {})
        self._index.dirty = loaded is None  # written at the first save, even when empty
        self._queue.start()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the caller's side -------------------------------------------------------------------

    def put(self, key: str, tokens: Sequence[int],
            kv: Sequence[tuple[torch.Tensor, torch.Tensor]], wait: bool = True) -> bool:
        """Queue one block for writing: `tokens` (1..block_size) and per layer (K, V), each
        (H, block_size, D) or (1, H, block_size, D), e.g. `BlockManager.block_tensors`. Copies
        the tensors before returning. Returns whether a write was queued: False when the store is
        off, the block is already stored or queued (then it only counts as used), or it alone
        exceeds the budget. Waits only when max_pending_bytes are already queued (without
        `wait`, the block is dropped instead)."""
        if not is_key(key):
            raise ValueError(f"not a block key: {key!r}")
        if self.enabled and not self._queue.running:
            raise RuntimeError("the block store is closed")
        if not self.enabled or self.layout.payload_bytes > self.budget_bytes:
            return False
        with self._cond:
            listed = key in self._index
            if key in self._queue:
                return False
        if listed:  # one stat: another process sharing the dir may have evicted it
            present = block_path(self.root, key).exists()
            with self._cond:
                if present:
                    self._index.touch(key)
                    return False
                self._index.drop(key)
        # listed or queued meanwhile: not queued again
        return self._queue.add(Queued.of(key, tokens, kv, self.layout), wait,
                               skip=lambda: self._index.touch(key))

    def describe(self) -> str:
        return str(self.root)

    def batch_exists(self, keys: Sequence[str]) -> int:
        return next((i for i, key in enumerate(keys) if not self.exists(key)), len(keys))

    def exists(self, key: str) -> bool:
        """The block is queued, listed, or has a file (which is then listed). A listed block
        whose file another process deleted still reads as present until a `get` misses it."""
        if not self.enabled or not is_key(key):
            return False
        with self._cond:
            if key in self._queue or key in self._index:
                return True
        try:
            size = block_path(self.root, key).stat().st_size
        except OSError:
            return False
        with self._cond:
            self._index.use(key, size)
        return True

    def get(self, key: str) -> ReadResult:
        """The block, read and verified now (or copied from the write queue)."""
        if not self.enabled or not is_key(key):
            return ReadResult(None, ReadStatus.MISSING)
        with self._cond:
            queued = self._queue.read(key)
            if queued is not None:
                return queued
            self._readers[key] += 1
        try:
            return self._read(key)
        finally:
            with self._cond:
                self._readers[key] -= 1
                if not self._readers[key]:
                    del self._readers[key]

    def _read(self, key: str) -> ReadResult:
        from kvchat.cache.block_file import decode_block

        path = block_path(self.root, key)
        try:
            data = read_block_bytes(path)
        except OSError as exc:
            with self._cond:
                listed = self._index.drop(key) > 0
            if isinstance(exc, FileNotFoundError):
                gone = f"Disk cache block {key[:12]} was listed but its file is gone; dropped."
                return ReadResult(None, ReadStatus.MISSING, notice=gone if listed else None)
            return ReadResult(None, ReadStatus.MISSING,
                              notice=f"Disk cache block {path} could not be read ({exc}).")
        try:
            block = decode_block(data, key, self.layout)
        except BlockFileError as exc:
            where = self._quarantine(path)
            with self._cond:
                self._index.drop(key)
                self._counts["read_failures"] += 1
            return ReadResult(None, ReadStatus.CORRUPT,
                              notice=f"Disk cache block {key[:12]} not used ({exc}); {where}.")
        with self._cond:
            self._index.use(key, len(data))
            self._counts["reads"] += 1
        return ReadResult(block.kv, ReadStatus.HIT, block.tokens)

    def _quarantine(self, path: Path) -> str:
        """Move a damaged file to quarantine/ (keeping the newest few); says where it went."""
        folder = self.root / "quarantine"
        try:
            private_dir(folder, "the disk cache's quarantine folder")
            target = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{path.name}"
            os.replace(path, target)
        except (OSError, WriteError):
            with contextlib.suppress(OSError):
                path.unlink()
            return "deleted"
        kept = sorted(folder.iterdir(), key=lambda p: p.name)
        for old in kept[:-QUARANTINE_KEEP]:
            with contextlib.suppress(OSError):
                old.unlink()
        return f"moved to {target}"

    def flush(self) -> None:
        """Wait until the queue is empty, every block in it on disk (and the start-up
        reconciliation done), then save the index."""
        if not self._queue.running:
            return
        self._queue.flush()
        self._save_index()

    def close(self) -> None:
        """Flush, then stop the writer thread. The store takes no puts afterwards."""
        if not self._queue.running:
            return
        self.flush()
        self._queue.close()
        self._save_index()

    def take_notices(self) -> list[str]:
        """One-line notices from start-up and the writer thread, each returned once (a `get`'s
        own come in its ReadResult)."""
        with self._cond:
            out, self._notices = self._notices, []
        return out

    def stats(self) -> StoreStats:
        with self._cond:
            counts = self._counts
            return StoreStats(
                blocks=len(self._index), bytes=self._index.total_bytes,
                budget_bytes=self.budget_bytes, writes=counts["writes"], reads=counts["reads"],
                read_failures=counts["read_failures"], write_failures=counts["write_failures"],
                evictions=counts["evictions"], pending=len(self._queue),
            )

    # ---- the writer thread -------------------------------------------------------------------

    def _start(self) -> None:
        try:
            self._reconcile()
        except Exception as exc:  # the store still works; the next start-up tries again
            with self._cond:
                self._notices.append(f"Disk cache folder {self.root} not reconciled ({exc}).")

    def _save_due(self) -> float | None:
        """Seconds until the index is to be saved; None while it has nothing new (lock held)."""
        if not self._index.dirty:
            return None
        return self.index_every_s - (time.monotonic() - self._last_save)

    def _write(self, item: Queued) -> Settle:
        """Write one queued block into place; what it returns lists it (or counts the failure)
        and keeps the store within its budget as the block leaves the queue."""
        path = block_path(self.root, item.key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
        try:
            if path.parent.name not in self._shards:
                private_dir(path.parent.parent, "the disk cache folder")
                private_dir(path.parent, "the disk cache folder")
                self._shards.add(path.parent.name)
            size = self._write_file(tmp, item)
            os.replace(tmp, path)
        except Exception as exc:  # any: a dead writer thread would leave flush() waiting forever
            with contextlib.suppress(OSError):
                tmp.unlink()
            return partial(self._not_written, path, exc)
        return partial(self._written, item.key, size)

    def _written(self, key: str, size: int) -> None:
        self._index.use(key, size)
        self._counts["writes"] += 1
        self._evict_over_budget()

    def _not_written(self, path: Path, exc: Exception) -> None:
        self._notices.append(f"Disk cache block {path} not written ({exc}).")
        self._counts["write_failures"] += 1
        self.write_failure = (path, exc)

    def _write_file(self, tmp: Path, item: Queued) -> int:
        """Write the block to `tmp` (0600) and fsync it; returns its size."""
        from kvchat.cache.block_file import encode_block

        size = 0
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)  # the umask may have cleared bits
            for piece in encode_block(item.key, item.tokens, self.layout, item.kv):
                view = memoryview(piece)
                size += len(view)
                while view:  # os.write may write less than asked
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        return size

    def _evict_over_budget(self) -> None:
        """Delete least recently used files until the store fits its budget (lock held)."""
        total = self._index.total_bytes
        for key in self._index:
            if total <= self.budget_bytes:
                break
            if self._readers[key]:
                continue
            try:
                block_path(self.root, key).unlink()
            except FileNotFoundError:
                pass  # another process evicted it first
            except OSError as exc:
                self._notices.append(f"Disk cache block {key[:12]} could not be evicted ({exc}).")
                continue
            total -= self._index.drop(key)
            self._counts["evictions"] += 1

    def _reconcile(self) -> None:
        """Bring the index in line with the block folders: list unlisted files, drop entries
        without a file, remove temp files whose writer is dead. Runs before the first write."""
        with self._cond:
            before = set(self._index.entries)
        listing = scan_blocks(self.root, before)
        with self._cond:
            gone = [k for k in before - listing.files.keys() if self._index.drop(k)]
            # files found unlisted rank as used just before start-up: older than any use now
            stamp = time.time() - 1.0
            self._index.merge({k: (size, stamp) for k, size in listing.files.items()
                               if k not in before})
            if gone:
                self._notices.append(f"{len(gone)} block(s) listed in the disk cache's index "
                                     "had no file; dropped from it.")
            self._evict_over_budget()

    def _save_index(self) -> None:
        """Write index.json, listing too what another process listed whose files still exist."""
        with self._index_lock:
            with self._cond:
                if not self._index.dirty:
                    return
                self._index.dirty = False
                self._last_save = time.monotonic()
                ours = set(self._index.entries)
            theirs = (read_index(self.root) or ({}, 0))[0]
            found = {k: e for k, e in theirs.items()
                     if k not in ours and block_path(self.root, k).exists()}
            with self._cond:
                self._index.merge(found)
                self._index.dirty = False
                doc = self._index.document(self.budget_bytes)
            try:
                atomic_write(self.root / BLOCK_INDEX, json.dumps(doc).encode(),
                             "the disk cache index")
            except WriteError as exc:
                with self._cond:
                    self._index.dirty = True
                    self._notices.append(str(exc))

