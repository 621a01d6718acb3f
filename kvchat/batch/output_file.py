"""The `-o` file of one `kvchat batch` run, held for that run alone.

Two runs writing one output would each append their rows and then rewrite the file in input
order with only their own rows: one run's finished rows would be lost without a word. So the
file is locked (an exclusive `flock`) before anything is written and stays locked through the
final rewrite: the rewritten file (a new inode, renamed into place) is locked before the
rename, and a run that locked a file since renamed away notices and takes the new one. A
second run on a locked file is refused at once, before it loads a model.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from kvchat.errors import KvchatError

_OPEN_TRIES = 100  # a file renamed away between our open and our lock, again and again


class OutputError(KvchatError):
    """The output file could not be read or written, or another run is writing it."""


class OutputClosed(OutputError):
    """Whoever read the rows on stdout has gone (`kvchat batch f | head -1`): end quietly."""


def _busy(path: Path) -> OutputError:
    return OutputError(
        f"Another kvchat batch is writing {path} now: two runs writing one file would lose one "
        "run's rows. Wait for it to finish (or stop it), or write to another -o file; nothing "
        "was run.")


def _same_file(fd: int, path: Path) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def _locked(path: Path, flags: int) -> int:
    """A descriptor on `path` holding its exclusive lock; OutputError when another run holds
    it."""
    for _ in range(_OPEN_TRIES):
        fd = os.open(path, flags, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _busy(path) from None
        if _same_file(fd, path):
            return fd
        os.close(fd)  # the holder renamed a new file into place and let go: lock that one
    raise _busy(path)


class OutputFile:
    """`path`, locked for this run from `hold` until `close`. Rows are appended through
    `start`'s stream; `rewrite` replaces the whole file atomically, still under the lock."""

    def __init__(self, path: Path, fd: int, created: bool = False) -> None:
        self.path = path
        self._fd = fd
        self._fh: IO[str] | None = None
        self._unused = created  # made by `hold` and not written yet: `close` removes it

    @classmethod
    def hold(cls, path: Path) -> OutputFile:
        """Lock `path` (created if missing, its content untouched) for this run."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            existed = path.exists()
            return cls(path, _locked(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND),
                       created=not existed)
        except OSError as exc:
            raise OutputError(f"Cannot write {path} ({exc.strerror or exc}).") from None

    def start(self, keep: bool) -> IO[str]:
        """The stream rows are appended to: after what the file holds with `keep` (a resumed
        run), else from an empty file."""
        self._unused = False
        try:
            if not keep:
                os.ftruncate(self._fd, 0)
            self._fh = os.fdopen(os.dup(self._fd), "a", encoding="utf-8")
        except OSError as exc:
            raise OutputError(f"Cannot write {self.path} ({exc.strerror or exc}).") from None
        return self._fh

    def rewrite(self, lines: Iterable[str]) -> None:
        """Replace the file with `lines` (each ending in a newline): a temporary file, locked,
        fsynced and renamed into place, so that readers see the old file or the new one and no
        other run can take the file in between. Raises OSError."""
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.close()
            self._fh = None
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # nobody else can know this file yet
            with os.fdopen(os.dup(fd), "w", encoding="utf-8") as fh:
                fh.writelines(lines)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        os.close(self._fd)  # the old file is gone from the folder: its lock guards nothing
        self._fd = fd

    def close(self) -> None:
        """Let go of the file (and its lock); one this run made and never wrote is removed, so
        a run that stopped before its first row leaves nothing behind."""
        if self._unused and self._fd >= 0 and _same_file(self._fd, self.path):
            with contextlib.suppress(OSError):
                self.path.unlink()
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.close()
            self._fh = None
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
