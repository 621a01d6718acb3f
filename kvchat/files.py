"""Private, atomic files: everything kvchat writes that may hold prompt text (sessions, the
cache's index and blocks, the lock) is 0600 in 0700 folders whatever the umask, replaced
atomically, and a failed write is one paragraph saying what to do."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from kvchat.errors import KvchatError

DIR_MODE, FILE_MODE = 0o700, 0o600
KEPT = " Any previous version of it is unchanged."  # how an atomic write's error ends


class WriteError(KvchatError):
    """A file kvchat keeps could not be written (read-only folder, full disk, ...)."""


def write_error(what: str, path: Path, exc: Exception, atomic: bool = True) -> WriteError:
    """The user's paragraph for a failed write (`atomic`: one that left any old version)."""
    found = re.search(r"os error (\d+)", str(exc))  # how safetensors reports the errno
    code = exc.errno if isinstance(exc, OSError) else int(found.group(1)) if found else None
    if code in (errno.ENOSPC, errno.EDQUOT):
        advice = "the disk is full. Free some space and try again"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        advice = (f"the folder is not writable. Make {path.parent} writable (chmod u+w), or "
                  "point kvchat at another folder with --sessions-dir")
    else:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        advice = f"{reason}. Check {path.parent}, or use another folder with --sessions-dir"
    kept = KEPT if atomic else ""
    return WriteError(f"Could not write {what} ({path}): {advice}.{kept}")


def private_dir(path: Path, what: str = "the sessions folder") -> Path:
    """Create `path` 0700, or drop its group and other bits. Every folder it creates on the way
    is 0700 too (a `cache/` made for `cache/store/` is as private as the store); folders that
    already exist above it are the user's, as they are."""
    try:
        if not path.is_dir():
            missing: list[Path] = []
            folder = path
            while not folder.is_dir() and folder != folder.parent:
                missing.append(folder)
                folder = folder.parent
            for folder in reversed(missing):
                with contextlib.suppress(FileExistsError):  # another process made it first
                    folder.mkdir(mode=DIR_MODE)
                    os.chmod(folder, DIR_MODE)  # mkdir's mode goes through the umask
            return path
    except OSError as exc:
        raise write_error(what, path, exc, atomic=False) from exc
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:  # keep the owner's bits: a folder made read-only on purpose stays so
        with contextlib.suppress(OSError):  # not ours to change: the writes then say why
            os.chmod(path, mode & DIR_MODE)
    return path


def open_private(path: Path, flags: int) -> int:
    """A file descriptor on `path`, created 0600 (existing files are tightened to 0600)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
    with contextlib.suppress(OSError):  # only fails on another user's file: not ours to change
        os.fchmod(fd, FILE_MODE)  # the umask may have cleared bits, or the file predates us
    return fd


def atomic_write(path: Path, data: bytes, what: str = "a file") -> None:
    """Write data to path (0600, in a private folder) so that readers see the old file or the
    new one, never a mix. On failure the temp file is removed and WriteError raised."""
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        fd = open_private(tmp, os.O_WRONLY | os.O_TRUNC)
        try:
            view = memoryview(data)
            while view:  # os.write may write less than asked
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise write_error(what, path, exc) from exc
    with contextlib.suppress(OSError):  # make the rename itself durable
        dirfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)


@contextlib.contextmanager
def read_map(path: Path | str) -> Iterator[mmap.mmap]:
    """`path` memory-mapped read-only. Closed on the way out unless arrays still view it (a
    traceback holding a reader's frame, a profiler's sampled stack): then it closes with its
    last view, and the error that ended the block, if any, is the one raised, never
    "cannot close exported pointers"."""
    with open(path, "rb") as fh:
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        yield buf
    finally:
        with contextlib.suppress(BufferError):
            buf.close()

