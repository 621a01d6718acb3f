"""Weights in huge pages (models/heap.py): `huge_empty` gives a large tensor a mapping of its
own, on a 2 MiB boundary and advised for huge pages, released with the tensor; small ones are
plain torch.empty; `huge_cat` is torch.cat into such memory."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from kvchat.models.heap import HUGE_FROM, HUGE_PAGE, huge_cat, huge_empty

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's madvise")


def _mapping(address: int) -> dict[str, str] | None:
    """/proc/self/smaps' fields of the mapping holding `address` (None: none holds it)."""
    found: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            if found is not None:
                return found
            found = {} if lo <= address < hi else None
        elif found is not None and ":" in line:
            key, _, value = line.partition(":")
            found[key] = value.strip()
    return found


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[")[1].split("]")[0]


@linux
def test_a_large_tensor_gets_its_own_aligned_mapping_advised_for_huge_pages():
    shape = (HUGE_FROM // 2048 + 3, 1024)  # past HUGE_FROM, not a whole number of huge pages
    tensor = huge_empty(shape, torch.float16)
    assert tensor.shape == shape and tensor.dtype == torch.float16 and tensor.is_contiguous()
    assert tensor.data_ptr() % HUGE_PAGE == 0
    values = torch.randn(shape).half()
    tensor.copy_(values)
    assert torch.equal(tensor, values)
    mapping = _mapping(tensor.data_ptr())
    assert mapping is not None
    if _thp_mode() in ("madvise", "always"):
        assert "hg" in mapping["VmFlags"].split()  # MADV_HUGEPAGE took
    address, view = tensor.data_ptr(), tensor[5:7].clone()
    del tensor, values
    gc.collect()
    assert _mapping(address) is None  # unmapped with its tensor
    assert view.shape == (2, 1024)


def test_small_tensors_and_stacking():
    small = huge_empty((16, 16), torch.int8)
    assert small.shape == (16, 16) and small.dtype == torch.int8
    parts = [torch.randint(0, 255, (n, HUGE_FROM // 512), dtype=torch.uint8) for n in (300, 700)]
    stacked = huge_cat(parts)
    assert torch.equal(stacked, torch.cat(parts))
    if sys.platform.startswith("linux"):
        assert stacked.data_ptr() % HUGE_PAGE == 0
