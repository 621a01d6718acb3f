"""The lock of a sessions dir: one kvchat process uses a dir at a time (a second waits briefly,
then is told who holds it), and the lock file says who that is, as one JSON object: its pid, what
it is, since when, and for `kvchat serve` where it listens and its access token (0600)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, NamedTuple

from kvchat.errors import KvchatError
from kvchat.files import open_private, private_dir, write_error
from kvchat.sessions import RESERVED, cache_dir

# Temp files of writes killed midway: ours (`.<name>.<pid>-<thread>.tmp`,
# `.kv-<id>.safetensors.tmp`) and the one safetensors renames from (`.tmp` + 6 characters).
_TEMP_RE = re.compile(r"\..+\.(\d+(-\d+)?|safetensors)\.tmp")
_SAFETENSORS_TEMP_RE = re.compile(r"\.tmp[A-Za-z0-9]{6}")


class SessionsLocked(KvchatError):
    pass


def sweep_temp_files(root: Path) -> None:
    """Remove temp files left by saves that were killed midway (some are snapshot-sized) from the
    sessions dir and its cache/ folder, and make cache/ and cache/set-aside/ private.
    Call it only while holding the lock: every kvchat process writing to this dir holds it, so no
    temp file found then belongs to a write still in progress."""
    for folder, extra in ((root, _TEMP_RE), (cache_dir(root), _SAFETENSORS_TEMP_RE)):
        for item in folder.iterdir() if folder.is_dir() else ():
            if item.name in RESERVED and item.is_dir():  # cache/, cache/set-aside/
                private_dir(item)
            elif ((_TEMP_RE.fullmatch(item.name) or extra.fullmatch(item.name))
                  and item.is_file() and not item.is_symlink()):
                with contextlib.suppress(OSError):
                    item.unlink()


class LockHolder(NamedTuple):
    """Who holds a sessions dir, as its lock file says: a `kvchat serve` also records where it
    listens and its access token (the file is 0600, so only the owner reads the token)."""

    pid: int
    what: str
    since: str
    url: str | None = None
    token: str | None = None

    def describe(self) -> str:
        return f"pid {self.pid} ({self.what}, since {self.since})"


class HeldLock:
    """The lock a process holds; `publish` records the address and token of a server."""

    def __init__(self, fh: IO[str], holder: LockHolder) -> None:
        self._fh = fh
        self.holder = holder
        self._write()

    def publish(self, url: str, token: str | None) -> None:
        self.holder = self.holder._replace(url=url, token=token)
        self._write()

    def withdraw(self) -> None:
        """Forget the address and token (the server is gone); the last holder stays named."""
        if self.holder.url is not None or self.holder.token is not None:
            self.holder = self.holder._replace(url=None, token=None)
            self._write()

    def _write(self) -> None:
        with contextlib.suppress(OSError):  # who holds it is a courtesy; the flock is the lock
            self._fh.seek(0)
            self._fh.truncate()
            # plain JSON, for kvchat and any other tool ("what" and "since" name the holder)
            self._fh.write(json.dumps(self.holder._asdict()) + "\n")
            self._fh.flush()


def _parse_holder(text: str) -> LockHolder | None:
    try:
        # one JSON object; an older kvchat wrote a line for people before it
        data = json.loads(text.strip().splitlines()[-1])
        return LockHolder(int(data["pid"]), str(data["what"]), str(data["since"]),
                          data.get("url"), data.get("token"))
    except (ValueError, KeyError, TypeError, IndexError):
        return None  # an older kvchat's plain line, or a torn write


def lock_holder(root: Path) -> LockHolder | None:
    """Who holds the sessions dir now, or None when nobody does (the lock is free, or the dir
    has no lock file). Reads without taking the lock for more than an instant."""
    path = Path(root) / ".lock"
    try:
        fh = os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "r")
    except OSError:
        return None
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: its holder wrote who it is
            return _parse_holder(fh.read().strip()) or LockHolder(0, "another process", "?")
        fcntl.flock(fh, fcntl.LOCK_UN)
        return None


@contextlib.contextmanager
def sessions_lock(root: Path, what: str, wait_s: float = 3.0) -> Iterator[HeldLock]:
    """Hold the sessions dir for this process; a second process waits briefly, then is told
    who holds it. Taking it makes the dir private and sweeps orphan temp files."""
    path = private_dir(root) / ".lock"
    try:
        fh = os.fdopen(open_private(path, os.O_RDWR), "r+")
    except OSError as exc:
        raise write_error("the lock file", path, exc, atomic=False) from exc
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    fh.seek(0)
                    text = fh.read().strip()
                    found = _parse_holder(text)
                    holder = found.describe() if found else text or "another process"
                    raise SessionsLocked(
                        f"The sessions dir {root} is in use by {holder}. Close that kvchat, or "
                        "point this one at another folder with --sessions-dir."
                    ) from None
                time.sleep(0.1)
        sweep_temp_files(root)
        held = HeldLock(fh, LockHolder(os.getpid(), what, time.strftime("%H:%M:%S")))
        try:
            yield held
        finally:
            held.withdraw()  # no token outlives the server on disk
    finally:
        fh.close()  # closing drops the flock
