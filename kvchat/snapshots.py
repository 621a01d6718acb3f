"""The cache's index in a sessions dir: `cache/index.json`, the snapshot's tree index (the radix
tree with each node's tokens and block keys, counters, fingerprint; its schema and reader are
`kvchat.cache.tree_index`'s, readable without torch). The K/V live in the disk tier
(`kvchat.cache.block_store`, `cache/store/` by default). Saves are atomic and private like every
file of a sessions dir; an index that does not match, parse or fit is set aside with a notice,
never deleted."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchat.cache import tree_index
from kvchat.cache.tree_index import TREE_INDEX, SnapshotMismatch, read_tree, walk_records
from kvchat.errors import KvchatError
from kvchat.files import KEPT, write_error
from kvchat.sessions import (
    atomic_write,
    cache_dir,
    move_file,
    private_dir,
)

EXACT = "exact"  # beside the index: one file per exact entry's logits row


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
        """Tokens the saved tree holds. Raises ValueError if it is damaged."""
        return sum(len(rec.tokens) for rec in walk_records(read_tree(self.meta)))


def read_snapshot_meta(root: Path) -> SnapshotInfo | None:
    """index.json of the snapshot, or None if there is none. Raises ValueError if it is damaged."""
    path = cache_dir(root) / TREE_INDEX
    if not path.exists():
        return None
    meta = json.loads(path.read_text())
    if not isinstance(meta, dict) or "tree" not in meta:
        raise ValueError("index.json lacks the tree")
    return SnapshotInfo(path, meta)


def set_aside_snapshot(root: Path) -> Path:
    """Move the index (and a version 1 snapshot's K/V files) into cache/set-aside/<stamp>/;
    the disk tier's folder stays: its blocks are keyed by what they depend on."""
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
    """Persist the cache: its blocks into the disk tier (only those not stored yet: a save
    costs the turn's new blocks), then index.json, the tree with block keys, atomically. A
    failed write (a block, an exact entry's logits, the index) raises SessionWriteError and
    leaves the previous snapshot as it was: its index, and every exact entry's file it lists
    (stale ones go only once the new index is in)."""
    folder = private_dir(cache_dir(private_dir(Path(root))))
    meta = tree_index.export_index(cache)
    listed = {rec["logits"] for rec in meta.get("exact", [])}
    _save_exact(folder / EXACT, tree_index.exact_logits(cache), listed)
    meta.update(extra)
    meta.update(fingerprint=fingerprint, snapshot_id=uuid.uuid4().hex[:12], saved_at=time.time())
    atomic_write(folder / TREE_INDEX, json.dumps(meta).encode(), "the cache index")
    _drop_exact(folder / EXACT, listed)
    return folder / TREE_INDEX


def not_saved(root: Path, exc: Exception) -> str:
    """One paragraph for a save that failed (`save_snapshot`'s error, or any OSError): what
    failed and what to do, then what the next start gets (the previous snapshot, unchanged)."""
    index = cache_dir(root) / TREE_INDEX
    error = exc if isinstance(exc, KvchatError) else write_error("the cache snapshot", index, exc)
    try:
        info = read_snapshot_meta(root)
    except (OSError, ValueError):  # damaged: the next start sets it aside, as it would anyway
        info = None
    if info is not None:
        saved = info.meta.get("saved_at")
        when = f", saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(saved))}" \
            if isinstance(saved, int | float) else ""
        kept = (f"The last good snapshot ({index}{when}) is unchanged: the next start restores "
                "it, without what was cached since.")
    else:
        kept = f"There is no earlier snapshot in {index.parent}: the next start begins empty."
    return f"The cache snapshot was not saved. {str(error).removesuffix(KEPT)} {kept}"


def _save_exact(folder: Path, logits: dict[str, Any], keep: set[str]) -> None:
    """Each live exact entry's logits row in a file of its own, written once (the name hashes
    the prompt)."""
    from safetensors.torch import save

    private_dir(folder, "the exact entries' folder")
    for name, row in logits.items():
        path = folder / f"{name}.safetensors"
        if name in keep and not path.exists():
            data = save({"logits": row.detach().to("cpu").contiguous()})
            atomic_write(path, data, "an exact entry's logits")


def _drop_exact(folder: Path, keep: set[str]) -> None:
    """Remove the files of exact entries not in `keep` (the names the index lists)."""
    for old in folder.glob("*.safetensors"):
        if old.stem not in keep:
            with contextlib.suppress(OSError):
                old.unlink()


def _exact_loader(folder: Path, device: Any) -> Any:
    """Reads one saved logits row on first hit; None when it is missing or damaged."""

    def load(name: str) -> Any:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(folder / f"{name}.safetensors"))["logits"].to(device)
        except (OSError, SafetensorError, KeyError):
            return None

    return load


def _old_files(root: Path) -> bool:
    """K/V files of a version 1 snapshot, which the disk tier replaced."""
    return any(cache_dir(root).glob("kv-*.safetensors"))


def load_snapshot(root: Path, cache: Any, fingerprint: dict[str, Any]) -> SnapshotLoad:
    """Rebuild the cache's tree from index.json, every block on disk (loaded when first hit),
    when its fingerprint matches. An index that does not match, parse or fit, and a version 1
    snapshot (one K/V file), are set aside with a one-line notice; never a crash."""
    try:
        info = read_snapshot_meta(root)
    except (OSError, ValueError) as exc:
        where = set_aside_snapshot(root)
        return SnapshotLoad(False, f"Cache snapshot unreadable ({exc}); set aside in {where}.")
    if info is None:
        if _old_files(root):
            set_aside_snapshot(root)
        return SnapshotLoad(False, None)
    if info.meta.get("version") == 1 or "kv_file" in info.meta:
        where = set_aside_snapshot(root)
        return SnapshotLoad(False, "The cache snapshot is in the old single-file format; it "
                                   f"was set aside in {where} and the cache starts empty.")
    if info.fingerprint != fingerprint:
        differ = sorted(k for k in fingerprint.keys() | info.fingerprint.keys()
                        if fingerprint.get(k) != info.fingerprint.get(k))
        where = set_aside_snapshot(root)
        return SnapshotLoad(False, f"Cache snapshot was made with a different "
                                   f"{', '.join(differ)}; set aside in {where}.")
    try:
        loader = _exact_loader(cache_dir(root) / EXACT, cache.manager.devices[-1])
        tree_index.import_index(cache, info.meta, loader)
    except SnapshotMismatch as exc:
        where = set_aside_snapshot(root)
        return SnapshotLoad(False, f"Cache snapshot not loaded ({exc}); set aside in {where}.")
    return SnapshotLoad(True, None, info.cached_tokens)
