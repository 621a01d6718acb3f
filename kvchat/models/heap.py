"""The process heap during a load: glibc keeps freed heap pages mapped, so a load's float32
intermediates and a tokenizer's passing peak would stay resident. `release_heap` hands freed
pages back now, `release_freed` once enough has been freed, and `heap_mmap_threshold` keeps
large temporaries in mappings of their own while loading. Nothing where there is no glibc."""

from __future__ import annotations

from typing import Any


def release_freed(freed: int) -> None:
    """Hand the heap's freed pages back to the system (glibc's malloc_trim) once every
    `TRIM_EVERY` bytes of float32 intermediates freed: glibc keeps freed heap memory mapped,
    and the process would stay at the load's peak (a Qwen2 0.5B-shaped Q4_K_M: 2.3 GiB
    resident after loading, 1.0 GiB trimmed). A trim walks the heap (tens of ms), hence not
    after every tensor. Nothing where there is no glibc."""
    global _FREED
    _FREED += freed
    if _FREED >= TRIM_EVERY:
        release_heap()
        _FREED = 0


def release_heap() -> None:
    """Hand every freed heap page back to the system now (glibc's malloc_trim; nothing where
    there is no glibc): after a step whose transient allocations dwarf what it keeps."""
    if _libc() is not None:
        _libc().malloc_trim(0)


_FREED = 0
TRIM_EVERY = 256 << 20
# glibc serves allocations above its mmap threshold with their own mappings, returned to the
# system when freed; the threshold grows with each such block freed (up to 32 MiB), after which
# a load's float32 tensors fragment the heap instead. Fixed low while loading (a Qwen2 0.5B-shaped
# Q4_K_M peaked at 1.74 GiB, 1.29 GiB with it), at glibc's ceiling after.
MMAP_THRESHOLD_LOADING = 4 << 20
MMAP_THRESHOLD_AFTER = 32 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number


def heap_mmap_threshold(size: int) -> None:
    if _libc() is not None:
        _libc().mallopt(_M_MMAP_THRESHOLD, size)


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC = lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else False
        except OSError:
            _LIBC = False
    return _LIBC or None


_LIBC: Any = None
