"""Sessions on disk: transcripts, the snapshot of the shared cache, and the lock.

Layout of a sessions dir (default ./sessions):
    <name>.json                 one session: messages, token history, per-turn stats
    cache/index.json            the cache snapshot's metadata (tree, blocks, exact entries, stats,
                                fingerprint); readable without torch (`kvchat inspect`)
    cache/kv-<id>.safetensors   the used blocks' K/V and stored logits, named by index.json
    cache/set-aside/            snapshots that did not match or did not parse (never deleted)
    .history                    the REPL's input history
    .lock                       held by the process using this dir

Every write is atomic (temp file, fsync, rename): an interrupted save leaves the previous state.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvchat.errors import KvchatError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
RESERVED = {"cache", "set-aside"}
INDEX = "index.json"


class SessionError(KvchatError):
    pass


def validate_name(name: str) -> str:
    if not NAME_RE.match(name) or name in RESERVED or name.endswith(".json"):
        raise SessionError(
            f"Invalid session name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting "
            "with a letter or digit (no path separators)."
        )
    return name


def atomic_write(path: Path, data: bytes) -> None:
    """Write data to path so that readers see the old file or the new one, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    with contextlib.suppress(OSError):  # make the rename itself durable
        dirfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)


# ---- sessions ------------------------------------------------------------------------------


@dataclass
class Turn:
    prompt_tokens: int
    hit_tokens: int
    source: str
    completion_tokens: int
    ttft_ms: float
    prefill_ms: float
    finish_reason: str

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class Session:
    """A conversation: its messages and the exact token history the model has seen, which the
    next turn extends (re-tokenising the transcript could split differently and miss the cache)."""

    name: str
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    def reset(self) -> None:
        self.messages.clear()
        self.tokens.clear()
        self.turns.clear()

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "system": self.system,
            "messages": self.messages,
            "tokens": self.tokens,
            "turns": [asdict(t) for t in self.turns],
            "created": self.created,
            "updated": self.updated,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Session:
        return cls(
            name=str(data["name"]),
            system=data.get("system"),
            messages=[dict(m) for m in data.get("messages", [])],
            tokens=[int(t) for t in data.get("tokens", [])],
            turns=[Turn(**t) for t in data.get("turns", [])],
            created=float(data.get("created", time.time())),
            updated=float(data.get("updated", time.time())),
        )


class SessionStore:
    """Session files in one sessions dir."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, name: str) -> Path:
        return self.root / f"{validate_name(name)}.json"

    def exists(self, name: str) -> bool:
        return self.path(name).exists()

    def load(self, name: str) -> Session:
        path = self.path(name)
        try:
            return Session.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            return Session(name)
        except (ValueError, KeyError, TypeError) as exc:
            aside = set_aside(path, self.root / "cache" / "set-aside")
            raise SessionError(
                f"Session file {path} could not be read ({exc}); it was moved to {aside}."
            ) from exc

    def save(self, session: Session) -> None:
        session.updated = time.time()
        atomic_write(self.path(session.name), json.dumps(session.to_json()).encode())

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.stem for p in self.root.glob("*.json") if NAME_RE.match(p.stem))

    def history_file(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root / ".history"


def set_aside(path: Path, folder: Path) -> Path:
    """Move a file that cannot be used out of the way, keeping it for the user to inspect."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}-{path.name}"
    os.replace(path, target)
    return target


# ---- the lock ------------------------------------------------------------------------------


class SessionsLocked(KvchatError):
    pass


@contextlib.contextmanager
def sessions_lock(root: Path, what: str, wait_s: float = 3.0) -> Iterator[None]:
    """Hold the sessions dir for this process; a second process waits briefly, then is told
    who holds it."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / ".lock"
    fh = open(path, "a+")
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    fh.seek(0)
                    holder = fh.read().strip() or "another process"
                    raise SessionsLocked(
                        f"The sessions dir {root} is in use by {holder}. Close that kvchat, or "
                        "point this one at another folder with --sessions-dir."
                    ) from None
                time.sleep(0.1)
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} ({what}, since {time.strftime('%H:%M:%S')})")
        fh.flush()
        yield
    finally:
        fh.close()  # closing drops the flock


# ---- the cache snapshot --------------------------------------------------------------------


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


def cache_dir(root: Path) -> Path:
    return Path(root) / "cache"


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
    target.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.name != "set-aside" and item.is_file():
            os.replace(item, target / item.name)
    return target


@dataclass(frozen=True)
class SnapshotLoad:
    loaded: bool
    notice: str | None  # one line for the user when the snapshot was set aside or skipped
    cached_tokens: int = 0


def save_snapshot(root: Path, cache: Any, fingerprint: dict[str, Any], extra: dict[str, Any]) -> (
    Path
):
    """Write the cache to <root>/cache atomically: the K/V file first under a fresh name, then
    index.json pointing at it (the switch), then old K/V files go."""
    from safetensors.torch import save_file

    from kvchat.cache.snapshot import export_state

    folder = cache_dir(root)
    folder.mkdir(parents=True, exist_ok=True)
    meta, tensors = export_state(cache)
    snap_id = uuid.uuid4().hex[:12]
    kv_name = f"kv-{snap_id}.safetensors"
    tmp = folder / f".{kv_name}.tmp"
    save_file(tensors, str(tmp), metadata={"snapshot_id": snap_id})
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, folder / kv_name)
    meta.update(extra)
    meta.update(fingerprint=fingerprint, kv_file=kv_name, snapshot_id=snap_id, saved_at=time.time())
    atomic_write(folder / INDEX, json.dumps(meta).encode())
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
        return SnapshotLoad(
            False,
            f"Cache snapshot was made with a different {', '.join(differ)}; set aside in {where}.",
        )
    kv_path = info.path.parent / str(info.meta["kv_file"])
    try:
        tensors = load_file(str(kv_path))
        import_state(cache, info.meta, tensors)
    except (OSError, SafetensorError, SnapshotMismatch, ValueError) as exc:
        where = set_aside_snapshot(root)
        return SnapshotLoad(False, f"Cache snapshot not loaded ({exc}); set aside in {where}.")
    return SnapshotLoad(True, None, info.cached_tokens)
