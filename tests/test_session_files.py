"""The sessions dir as files: private permissions whatever the umask, strict session names, a
clear error (never a traceback) when the folder is read-only or the disk is full, orphan temp
files swept under the lock, and one Session object per name through SessionStore.open."""

from __future__ import annotations

import errno
import importlib
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvchat.session_lock import sessions_lock
from kvchat.sessions import (
    Session,
    SessionError,
    SessionNotFound,
    SessionStore,
    SessionWriteError,
    atomic_write,
    private_dir,
    set_aside,
    validate_name,
)
from kvchat.snapshots import read_snapshot_meta, save_snapshot

REAL_OPEN, REAL_MKDIR, REAL_WRITE, REAL_REPLACE = os.open, os.mkdir, os.write, os.replace
REAL_SAVE_FILE = importlib.import_module("safetensors.torch").save_file


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(params=[0o022, 0o000], ids=["umask022", "umask000"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


class FakeCache:
    """Stands in for the cache: save_snapshot writes whatever export_index returns."""

    def __init__(self) -> None:
        self.version = 0

    def fill(self) -> FakeCache:
        self.version += 1
        return self


@pytest.fixture(autouse=True)
def fake_export(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvchat.cache.tree_index

    def export_index(cache: FakeCache) -> dict[str, Any]:
        return {"tree": [], "version": cache.version}

    monkeypatch.setattr(kvchat.cache.tree_index, "export_index", export_index)
    monkeypatch.setattr(kvchat.cache.tree_index, "exact_logits", lambda cache: {})


def save(root: Path, cache: FakeCache) -> Path:
    return save_snapshot(root, cache, {"model": "tiny"}, {"model_label": "tiny"})


def snapshot_files(root: Path) -> dict[str, bytes]:
    folder = root / "cache"
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


# ---- private files -------------------------------------------------------------------------


def test_everything_kvchat_writes_is_private_whatever_the_umask(umask, tmp_path):
    root = tmp_path / "s"
    with sessions_lock(root, "test"):
        store = SessionStore(root)
        store.save(Session("alpha", messages=[{"role": "user", "content": "secret"}]))
        history = store.history_file()
        cache = FakeCache()
        save(root, cache.fill())
        save(root, cache.fill())  # a second save replaces index.json
        assert read_snapshot_meta(root).meta["version"] == 2
        (root / "beta.json").write_text("{not json")
        os.chmod(root / "beta.json", 0o600)  # as kvchat wrote it, before it was damaged
        with pytest.raises(SessionError, match="moved"):
            store.load("beta")  # creates cache/set-aside/ and moves the file there
    from prompt_toolkit.history import FileHistory

    FileHistory(str(history)).store_string("a line typed at the prompt")
    dirs = [root, *(p for p in root.rglob("*") if p.is_dir())]
    files = [p for p in root.rglob("*") if p.is_file()]
    assert {p.relative_to(root).as_posix() for p in dirs} >= {".", "cache", "cache/set-aside"}
    names = {p.name for p in files}
    assert {"alpha.json", ".history", ".lock", "index.json"} <= names
    assert {str(p): oct(mode(p)) for p in dirs} == {str(p): "0o700" for p in dirs}
    assert {str(p): oct(mode(p)) for p in files} == {str(p): "0o600" for p in files}


def test_every_folder_made_on_the_way_is_private(umask, tmp_path):
    parent = tmp_path / "projects"
    parent.mkdir(mode=0o755)
    os.chmod(parent, 0o755)
    store = parent / "s" / "cache" / "store"
    assert private_dir(store) == store
    for folder in (parent / "s", parent / "s" / "cache", store):
        assert mode(folder) == 0o700, folder  # made here: private, whatever the umask
    assert mode(parent) == 0o755  # there before: the user's, as it was


def test_a_wider_existing_dir_is_tightened_but_not_its_parent(tmp_path):
    parent = tmp_path / "projects"
    root = parent / "s"
    (root / "cache" / "set-aside").mkdir(parents=True)
    for folder in (parent, root, root / "cache", root / "cache" / "set-aside"):
        os.chmod(folder, 0o755)
    (root / ".lock").write_text("")
    (root / ".history").write_text("old\n")
    for f in (root / ".lock", root / ".history"):
        os.chmod(f, 0o644)
    with sessions_lock(root, "test"):
        assert mode(root) == mode(root / "cache") == mode(root / "cache" / "set-aside") == 0o700
        assert mode(root / ".lock") == 0o600
    assert mode(SessionStore(root).history_file()) == 0o600
    assert (root / ".history").read_text() == "old\n"  # tightened, not truncated
    assert mode(parent) == 0o755


def test_a_read_only_dir_keeps_its_owner_bits(tmp_path):
    """Tightening drops group and other bits only: it never makes a read-only folder writable."""
    root = tmp_path / "s"
    root.mkdir()
    os.chmod(root, 0o555)
    assert private_dir(root) == root and mode(root) == 0o500
    os.chmod(root, 0o750)
    assert private_dir(root) == root and mode(root) == 0o700


# ---- names ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", ["abc\n", "abc\r", "a/b", "..", ".", "", "x" * 65, "\nabc", "a\x00", "cache"]
)
def test_bad_session_names_are_refused(bad, tmp_path):
    with pytest.raises(SessionError, match="Invalid session name"):
        validate_name(bad)
    with pytest.raises(SessionError):
        SessionStore(tmp_path).open(bad)


def test_good_session_names_and_listing(tmp_path):
    assert validate_name("x" * 64) == "x" * 64
    assert validate_name("a.b_c-1") == "a.b_c-1"
    (tmp_path / "abc\n.json").write_text("{}")  # a name a trailing-newline bug would list
    (tmp_path / "ok.json").write_text('{"name": "ok"}')
    assert SessionStore(tmp_path).names() == ["ok"]


# ---- read-only folders and full disks ------------------------------------------------------


@pytest.fixture
def read_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """Folders appended to the list become read-only: chmod 0500, and, since root ignores modes,
    os.open / os.mkdir refuse to create or write under them as a read-only folder would."""
    folders: list[Path] = []
    write = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def refused(path: object) -> bool:
        p = Path(os.fsdecode(path)).absolute()
        return any(p.parent == f for f in folders)

    def fake_open(path, flags, *args, **kwargs):
        if flags & write and refused(path):
            raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))
        return REAL_OPEN(path, flags, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        if refused(path):
            raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))
        return REAL_MKDIR(path, *args, **kwargs)

    def fake_replace(src, dst, *args, **kwargs):
        if refused(src) or refused(dst):
            raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(src))
        return REAL_REPLACE(src, dst, *args, **kwargs)

    if os.geteuid() == 0:
        monkeypatch.setattr(os, "open", fake_open)
        monkeypatch.setattr(os, "mkdir", fake_mkdir)
        monkeypatch.setattr(os, "replace", fake_replace)
    yield folders
    for f in folders:
        if f.exists():
            os.chmod(f, 0o700)


def make_read_only(folders: list[Path], folder: Path) -> None:
    folders.append(folder.absolute())
    os.chmod(folder, 0o500)


def assert_clear(exc: pytest.ExceptionInfo[SessionWriteError], *fragments: str) -> None:
    text = str(exc.value)
    assert "\n" not in text and "Traceback" not in text
    for fragment in fragments:
        assert fragment in text, text


def test_saving_a_session_in_a_read_only_dir_says_what_to_do(read_only, tmp_path):
    root = tmp_path / "s"
    store = SessionStore(root)
    store.save(Session("alpha", tokens=[1, 2]))
    before = (root / "alpha.json").read_bytes()
    make_read_only(read_only, root)
    with pytest.raises(SessionWriteError) as exc:
        store.save(Session("alpha", tokens=[1, 2, 3]))
    assert_clear(exc, "session 'alpha'", str(root / "alpha.json"), "not writable",
                 f"Make {root} writable", "--sessions-dir", "previous version")
    assert (root / "alpha.json").read_bytes() == before
    assert sorted(p.name for p in root.iterdir()) == ["alpha.json"]  # no temp file


def test_taking_the_lock_in_a_read_only_dir_says_what_to_do(read_only, tmp_path):
    root = tmp_path / "s"
    root.mkdir()
    make_read_only(read_only, root)
    with pytest.raises(SessionWriteError) as exc:
        with sessions_lock(root, "test"):
            pass
    assert_clear(exc, "the lock file", str(root / ".lock"), "not writable")


def test_a_sessions_dir_under_a_read_only_folder_says_what_to_do(read_only, tmp_path):
    parent = tmp_path / "p"
    parent.mkdir()
    make_read_only(read_only, parent)
    with pytest.raises(SessionWriteError) as exc:
        with sessions_lock(parent / "s", "test"):
            pass
    assert_clear(exc, "the sessions folder", str(parent / "s"), "not writable")
    with pytest.raises(SessionWriteError, match="the input history|the sessions folder"):
        SessionStore(parent / "s").history_file()


def test_a_snapshot_in_a_read_only_dir_says_what_to_do_and_keeps_the_old_one(
    read_only, tmp_path
):
    cache = FakeCache()
    save(tmp_path, cache.fill())
    before = snapshot_files(tmp_path)
    make_read_only(read_only, tmp_path / "cache")
    with pytest.raises(SessionWriteError) as exc:
        save(tmp_path, cache.fill())
    assert_clear(exc, "the cache index", str(tmp_path / "cache"), "not writable")
    assert snapshot_files(tmp_path) == before


def test_a_damaged_session_in_a_read_only_dir_says_what_to_do(read_only, tmp_path):
    (tmp_path / "cache" / "set-aside").mkdir(parents=True)
    (tmp_path / "beta.json").write_text("{not json")
    make_read_only(read_only, tmp_path)
    with pytest.raises(SessionWriteError) as exc:
        SessionStore(tmp_path).open("beta")
    assert_clear(exc, "beta.json into", str(tmp_path / "cache" / "set-aside"),
                 f"Make {tmp_path} writable")
    assert (tmp_path / "beta.json").read_text() == "{not json"


def fail_after(limit: int):
    """os.write that writes up to `limit` bytes in all, then fails as a full disk does."""
    written = 0

    def write(fd: int, data) -> int:
        nonlocal written
        if written >= limit:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = REAL_WRITE(fd, bytes(data[: limit - written]))
        written += n
        return n

    return write


def test_a_full_disk_during_a_save_keeps_the_previous_file(monkeypatch, tmp_path):
    store = SessionStore(tmp_path)
    store.save(Session("alpha", tokens=[1, 2]))
    before = (tmp_path / "alpha.json").read_bytes()
    monkeypatch.setattr(os, "write", fail_after(10))
    with pytest.raises(SessionWriteError) as exc:
        store.save(Session("alpha", tokens=list(range(1000))))
    monkeypatch.setattr(os, "write", REAL_WRITE)
    assert_clear(exc, "session 'alpha'", "the disk is full", "Free some space",
                 "previous version of it is unchanged")
    assert (tmp_path / "alpha.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alpha.json"]  # the temp file is gone


def test_atomic_write_writes_everything_when_the_os_writes_in_pieces(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "write", lambda fd, data: REAL_WRITE(fd, bytes(data[:7])))
    atomic_write(tmp_path / "f", b"x" * 100 + b"end")
    monkeypatch.setattr(os, "write", REAL_WRITE)
    assert (tmp_path / "f").read_bytes() == b"x" * 100 + b"end"


def test_threads_writing_one_file_each_leave_a_whole_version(tmp_path):
    datas = [bytes([i]) * 200_000 for i in range(6)]
    errors: list[BaseException] = []

    def worker(data: bytes) -> None:
        try:
            for _ in range(5):
                atomic_write(tmp_path / "index.json", data)
        except Exception as exc:  # reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(d,)) for d in datas]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert (tmp_path / "index.json").read_bytes() in datas
    assert [p.name for p in tmp_path.iterdir()] == ["index.json"]


def test_a_full_disk_while_writing_the_index_keeps_the_previous_one(monkeypatch, tmp_path):
    cache = FakeCache()
    save(tmp_path, cache.fill())
    before = snapshot_files(tmp_path)
    monkeypatch.setattr(os, "write", fail_after(0))
    with pytest.raises(SessionWriteError) as exc:
        save(tmp_path, cache.fill())
    monkeypatch.setattr(os, "write", REAL_WRITE)
    assert_clear(exc, "the cache index", "the disk is full")
    assert snapshot_files(tmp_path) == before
    save(tmp_path, cache)  # and the next save works
    assert read_snapshot_meta(tmp_path).meta["version"] == 2


# ---- orphan temp files ---------------------------------------------------------------------


def test_taking_the_lock_sweeps_orphan_temp_files_only(tmp_path):
    cache = tmp_path / "cache"
    (cache / "set-aside").mkdir(parents=True)
    orphans = [tmp_path / ".alpha.json.4242.tmp", tmp_path / ".beta.json.4242-1402.tmp",
               cache / ".kv-0123abcd4567.safetensors.tmp",
               cache / ".index.json.77.tmp", cache / ".tmpAb12Cd"]
    kept = [tmp_path / "alpha.json", tmp_path / "notes.tmp", tmp_path / ".history",
            tmp_path / ".tmpAb12Cd", cache / "index.json", cache / "kv-0123abcd4567.safetensors",
            cache / "set-aside" / ".index.json.77.tmp"]
    for path in orphans + kept:
        path.write_bytes(b"x" * 100)
    with sessions_lock(tmp_path, "test"):
        assert [p for p in orphans if p.exists()] == []
        assert [p for p in kept if not p.exists()] == []


# ---- one Session object per name -----------------------------------------------------------


def test_open_returns_one_session_per_name(tmp_path):
    SessionStore(tmp_path).save(Session("alpha", tokens=[1, 2, 3]))
    store = SessionStore(tmp_path)
    a = store.open("alpha")
    assert a.tokens == [1, 2, 3]
    (tmp_path / "alpha.json").write_text("{not json")  # loaded once: the file is not read again
    assert store.open("alpha") is a and store.open("alpha", create=False) is a
    fresh = store.open("beta")
    assert fresh.tokens == [] and store.open("beta", create=False) is fresh
    assert store.exists("beta") and not (tmp_path / "beta.json").exists()  # created, not saved
    fresh.tokens.append(9)
    store.save(fresh)
    assert SessionStore(tmp_path).open("beta").tokens == [9]


def test_open_without_create_names_the_missing_session(tmp_path):
    store = SessionStore(tmp_path)
    store.save(Session("alpha"))
    with pytest.raises(SessionNotFound) as exc:
        store.open("ghost", create=False)
    assert isinstance(exc.value, SessionError)
    assert "'ghost'" in str(exc.value) and "alpha" in str(exc.value)
    assert not store.exists("ghost")
    assert store.open("ghost") is store.open("ghost", create=False)


def test_a_saved_session_becomes_the_open_one(tmp_path):
    store = SessionStore(tmp_path)
    s = Session("gamma")
    store.save(s)
    assert store.open("gamma") is s
    assert store.load("gamma") is not s and store.load("gamma").to_json() == s.to_json()


def test_open_from_many_threads_gives_one_object(tmp_path):
    SessionStore(tmp_path).save(Session("alpha", tokens=list(range(5000))))
    store = SessionStore(tmp_path)
    seen: list[Session] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        seen.append(store.open("alpha"))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(seen) == 8 and all(s is seen[0] for s in seen)


def test_a_corrupt_session_file_is_reported_by_open(tmp_path):
    (tmp_path / "bad.json").write_text("[1, 2")
    with pytest.raises(SessionError, match="moved"):
        SessionStore(tmp_path).open("bad")
    aside = list((tmp_path / "cache" / "set-aside").iterdir())
    assert len(aside) == 1 and aside[0].read_text() == "[1, 2"


def test_set_aside_creates_private_folders(umask, tmp_path):
    (tmp_path / "x.json").write_text("{}")
    target = set_aside(tmp_path / "x.json", tmp_path / "cache" / "set-aside")
    assert target.exists() and mode(tmp_path / "cache") == mode(target.parent) == 0o700


def test_a_read_map_a_view_outlives_closes_later_and_keeps_the_blocks_error(tmp_path):
    """An array still viewing the map (a traceback's frame, a profiler's sampled stack) does not
    turn the block's own error into "cannot close exported pointers", nor fail a block that
    ended well; the map closes with its last view."""
    import numpy as np

    from kvchat.files import read_map

    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(16)))
    with read_map(path) as buf:
        kept = np.frombuffer(buf, np.uint8, 4, 8)
    assert kept.tolist() == [8, 9, 10, 11] and not buf.closed
    del kept
    with pytest.raises(ValueError, match="the reader's own"):
        with read_map(path) as buf:
            view = np.frombuffer(buf, np.uint8, 4)  # noqa: F841 (alive in the traceback)
            raise ValueError("the reader's own error")
    with read_map(path) as other:
        pass
    assert other.closed  # no view: closed on the way out
