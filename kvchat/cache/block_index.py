"""The disk tier's block index: which block files a store holds, their sizes, and when each was
last used (not the snapshot's tree index, `kvchat.cache.tree_index`, also named index.json).

index.json is a summary of the store's block folders that spares start-up a stat per file:
    {"version": 1, "budget_bytes": N, "entries": {key: [file bytes, last used (epoch seconds)]}}
The folders stay the truth (several processes may write them), so a store reconciles the two
(`scan_blocks`) in the background after opening, and adopts what other processes listed when it
saves. Plain Python: `kvchat inspect` reads it without torch (`read_disk_tier`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvchat.cache.block_keys import is_key

BLOCK_INDEX_VERSION = 1
BLOCK_INDEX = "index.json"
SUFFIX = ".kvb"
# Temp files of interrupted writes: `.<name>.<pid>-<thread>.tmp`, block files' and atomic_write's.
_TEMP_RE = re.compile(r"\..+\.(\d+)-\d+\.tmp")

Entry = tuple[int, float]  # (file bytes, last used: seconds since the epoch)


def block_path(root: Path, key: str) -> Path:
    return Path(root) / "blocks" / key[:2] / f"{key}{SUFFIX}"


@dataclass(frozen=True)
class DiskTier:
    """What the index says of a store: enough for `kvchat inspect`, read without torch."""

    blocks: int
    bytes: int
    budget_bytes: int

    def to_json(self) -> dict[str, int]:
        return asdict(self)


def read_index(root: Path) -> tuple[dict[str, Entry], int] | None:
    """(entries, budget) from a store's index.json; None when it is missing or damaged."""
    try:
        data = json.loads((Path(root) / BLOCK_INDEX).read_text())
        if data["version"] != BLOCK_INDEX_VERSION:
            return None
        entries = {str(k): (int(v[0]), float(v[1])) for k, v in data["entries"].items()
                   if is_key(str(k))}
        return entries, int(data.get("budget_bytes", 0))
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None


def read_disk_tier(root: Path) -> DiskTier:
    """The store's blocks, bytes and budget from its index alone (no block file is touched);
    a missing or damaged index reads as empty, as the store rebuilds it when next opened."""
    loaded = read_index(root)
    if loaded is None:
        return DiskTier(0, 0, 0)
    entries, budget = loaded
    return DiskTier(len(entries), sum(size for size, _ in entries.values()), budget)


@dataclass
class StoreIndex:
    """Entries in least-recently-used order (first = next to evict). Not thread-safe: the
    store's lock guards it. `dirty` says it changed since it was last saved."""

    entries: OrderedDict[str, Entry] = field(default_factory=OrderedDict)
    dirty: bool = False
    _clock: float = 0.0

    @classmethod
    def of(cls, entries: Mapping[str, Entry]) -> StoreIndex:
        return cls(OrderedDict(sorted(entries.items(), key=lambda kv: kv[1][1])))

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[str]:
        """Keys, least recently used first (a copy: callers may drop while iterating)."""
        return iter(list(self.entries))

    @property
    def total_bytes(self) -> int:
        return sum(size for size, _ in self.entries.values())

    def now(self) -> float:
        """Wall time (comparable across processes), strictly increasing within this one."""
        self._clock = max(time.time(), self._clock + 1e-6)
        return self._clock

    def touch(self, key: str) -> bool:
        """Mark a listed block as just used; False if it is not listed."""
        entry = self.entries.get(key)
        if entry is None:
            return False
        self.use(key, entry[0])
        return True

    def use(self, key: str, size: int) -> None:
        """List (or relist) a block file as just used."""
        self.entries[key] = (size, self.now())
        self.entries.move_to_end(key)
        self.dirty = True

    def drop(self, key: str) -> int:
        """Unlist a block; returns its size (0 if it was not listed)."""
        entry = self.entries.pop(key, None)
        self.dirty |= entry is not None
        return entry[0] if entry else 0

    def merge(self, found: Mapping[str, Entry]) -> None:
        """List files found on disk or in another process's index, each at its own stamp."""
        new = {k: e for k, e in found.items() if k not in self.entries}
        if new:
            merged = {**new, **self.entries}
            self.entries = OrderedDict(sorted(merged.items(), key=lambda kv: kv[1][1]))
            self.dirty = True

    def document(self, budget_bytes: int) -> dict[str, Any]:
        return {"version": BLOCK_INDEX_VERSION, "budget_bytes": budget_bytes,
                "entries": {k: list(v) for k, v in self.entries.items()}}


@dataclass(frozen=True)
class Listing:
    """A scan of a store's folders: its block files (key -> bytes; 0 when `known` said the size
    was not needed) and how many temp files of dead writers it removed."""

    files: dict[str, int]
    swept: int


def scan_blocks(root: Path, known: set[str]) -> Listing:
    """List the block files under root/blocks (a stat only for keys not in `known`) and remove
    temp files left by writers that are no longer alive (a live one's temp file is its write in
    progress, perhaps in another process)."""
    files: dict[str, int] = {}
    swept = 0
    blocks = Path(root) / "blocks"
    for folder in [Path(root), *(p for p in _listdir(blocks) if p.is_dir())]:
        for item in _listdir(folder):
            temp = _TEMP_RE.fullmatch(item.name)
            key = item.name.removesuffix(SUFFIX)
            if temp and not _alive(int(temp.group(1))):
                with contextlib.suppress(OSError):
                    item.unlink()
                    swept += 1
            elif folder != Path(root) and item.name.endswith(SUFFIX) and is_key(key):
                with contextlib.suppress(OSError):  # gone since the listing: not there
                    files[key] = 0 if key in known else item.stat().st_size
    return Listing(files, swept)


def _listdir(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
