"""The cache snapshot in a sessions dir: `cache/index.json` (tree, blocks, exact entries,
stats, fingerprint; readable without torch) and the K/V file it names. Saves are atomic and
private like every file of a sessions dir; a snapshot that does not match, parse or fit is set
aside with a notice, never deleted."""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchat.sessions import (
    FILE_MODE,
    SessionWriteError,
    atomic_write,
    cache_dir,
    move_file,
    open_private,
    private_dir,
    write_error,
)

INDEX = "index.json"


@dataclass(frozen=True)
class SnapshotInfo:
    """What is known from index.json alone."""

    path: Path
    meta: dict[str, Any]

    @property
    def fingerprint(self) -> dict[str, Any]:
        return dict(self.meta.get("fingerprint", {}))

    @property
    def cached_tokens(self) -> int:
        return sum(len(b["tokens"]) for b in self.meta.get("blocks", []))


def read_snapshot_meta(root: Path) -> SnapshotInfo | None:
    """index.json of the snapshot, or None if there is none. Raises ValueError if it is damaged."""
    path = cache_dir(root) / INDEX
    if not path.exists():
        return None
    meta = json.loads(path.read_text())
    if not isinstance(meta, dict) or "tree" not in meta or "kv_file" not in meta:
        raise ValueError("index.json lacks the tree or the K/V file name")
    return SnapshotInfo(path, meta)


def set_aside_snapshot(root: Path) -> Path:
    """Move the whole current snapshot (index and K/V files) into cache/set-aside/<stamp>/."""
    folder = cache_dir(root)
    target = folder / "set-aside" / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    for part in (folder / "set-aside", target):
        private_dir(part, "the set-aside folder")
    for item in folder.iterdir():
        if item.name != "set-aside" and item.is_file():
            move_file(item, target / item.name)
    return target


@dataclass(frozen=True)
class SnapshotLoad:
    loaded: bool
    notice: str | None  # one line for the user when the snapshot was set aside or skipped
    cached_tokens: int = 0


def save_snapshot(root: Path, cache: Any, fingerprint: dict[str, Any],
                  extra: dict[str, Any]) -> Path:
    """Write the cache to <root>/cache atomically: the K/V file first under a fresh name, then
    index.json pointing at it (the switch), then old K/V files go. A failed write raises
    SessionWriteError and leaves the previous snapshot as it was, with no new file beside it."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from kvchat.cache.snapshot import export_state

    folder = private_dir(cache_dir(private_dir(Path(root))))
    meta, tensors = export_state(cache)
    snap_id = uuid.uuid4().hex[:12]
    kv_name = f"kv-{snap_id}.safetensors"
    kv_path, tmp = folder / kv_name, folder / f".{kv_name}.tmp"
    meta.update(extra)
    meta.update(fingerprint=fingerprint, kv_file=kv_name, snapshot_id=snap_id, saved_at=time.time())
    try:
        os.close(open_private(tmp, os.O_WRONLY))  # 0600 from the start, whatever the umask
        save_file(tensors, str(tmp), metadata={"snapshot_id": snap_id})
        os.chmod(tmp, FILE_MODE)  # safetensors may have replaced the file with its own
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, kv_path)
        atomic_write(folder / INDEX, json.dumps(meta).encode(), "the cache snapshot's index")
    except (OSError, SafetensorError, SessionWriteError) as exc:
        for orphan in (tmp, kv_path):  # the old index still names the old K/V file
            with contextlib.suppress(OSError):
                orphan.unlink()
        if isinstance(exc, SessionWriteError):
            raise
        raise write_error("the cache snapshot's K/V", kv_path, exc) from exc
    for old in folder.glob("kv-*.safetensors"):
        if old.name != kv_name:
            with contextlib.suppress(OSError):
                old.unlink()
    return folder / INDEX


def load_snapshot(root: Path, cache: Any, fingerprint: dict[str, Any]) -> SnapshotLoad:
    """Fill an empty cache from the snapshot when its fingerprint matches. A snapshot that does
    not match, parse or fit is set aside with a one-line notice; never a crash, never deleted."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from kvchat.cache.snapshot import SnapshotMismatch, import_state

    try:
        info = read_snapshot_meta(root)
    except (OSError, ValueError) as exc:
        where = set_aside_snapshot(root)
        return SnapshotLoad(False, f"Cache snapshot unreadable ({exc}); set aside in {where}.")
    if info is None:
        return SnapshotLoad(False, None)
    if info.fingerprint != fingerprint:
        differ = sorted(k for k in fingerprint.keys() | info.fingerprint.keys()
                        if fingerprint.get(k) != info.fingerprint.get(k))
        where = set_aside_snapshot(root)
        return SnapshotLoad(False, f"Cache snapshot was made with a different "
                                   f"{', '.join(differ)}; set aside in {where}.")
    kv_path = info.path.parent / str(info.meta["kv_file"])
    try:
        tensors = load_file(str(kv_path))
        import_state(cache, info.meta, tensors)
    except (OSError, SafetensorError, SnapshotMismatch, ValueError) as exc:
        where = set_aside_snapshot(root)
        return SnapshotLoad(False, f"Cache snapshot not loaded ({exc}); set aside in {where}.")
    return SnapshotLoad(True, None, info.cached_tokens)
