"""The process heap during a load: glibc keeps freed heap pages mapped, so a load's float32
intermediates and a tokenizer's passing peak would stay resident. `release_heap` hands freed
pages back now, `release_freed` once enough has been freed, and `heap_mmap_threshold` keeps
large temporaries in mappings of their own while loading. Nothing where there is no glibc.

`huge_empty` gives the weights a decode step streams memory of their own in 2 MiB pages where
the system offers them (Linux's transparent huge pages, in "madvise" or "always" mode)."""

from __future__ import annotations

import math
import mmap
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


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


HUGE_PAGE = 2 << 20
HUGE_FROM = 2 * HUGE_PAGE  # smaller tensors gain little: most of them would be on 4 KiB pages
_MADV_HUGEPAGE = 14


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor like torch.empty; from HUGE_FROM bytes on Linux, in a mapping of
    its own that starts on a 2 MiB boundary and asks for huge pages (MADV_HUGEPAGE) over its
    whole 2 MiB spans before any is touched (the rest stays on 4 KiB pages: nothing is resident
    that the tensor does not hold). A decode step reads every weight once, a TLB miss every
    4 KiB on small pages: a Llama 1B-shaped step took 2-3.5% longer on them (docs/performance.md).
    The mapping goes when the tensor does."""
    import torch

    n_bytes = math.prod(shape) * dtype.itemsize
    libc = _libc()
    if n_bytes < HUGE_FROM or libc is None or not sys.platform.startswith("linux"):
        return torch.empty(shape, dtype=dtype)
    import ctypes

    # the tensor keeps `region` (its buffer) alive; unmapped when both are gone
    region = mmap.mmap(-1, n_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    start = -base % HUGE_PAGE
    libc.madvise(ctypes.c_void_p(base + start), ctypes.c_size_t(n_bytes // HUGE_PAGE * HUGE_PAGE),
                 _MADV_HUGEPAGE)  # refused (no THP, an old kernel): 4 KiB pages, as before
    flat = torch.frombuffer(region, dtype=torch.uint8, count=n_bytes, offset=start)
    return flat.view(dtype).view(shape)


def huge_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat of `tensors` along their rows, into `huge_empty` memory."""
    import torch

    first = tensors[0]
    out = huge_empty((sum(int(t.shape[0]) for t in tensors), *first.shape[1:]), first.dtype)
    return torch.cat(tensors, dim=0, out=out)
