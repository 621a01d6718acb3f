"""How the benches time things: one `measure` for every figure, and `timed` for one run of a
device operation.

Every figure is a `Timing` in seconds (kvchat.bench.results); `format_seconds` there prints one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

import torch

from kvchat.bench.results import Timing

T = TypeVar("T")


class Timed(NamedTuple, Generic[T]):
    seconds: float
    value: T  # what the timed operation returned


def measure(trial: Callable[[], float | None], trials: int, warmup: int = 1) -> Timing:
    """Run `trial` `warmup` times untimed, then `trials` times. Each run's figure is what it
    returns, the seconds of its own timed part (so setup stays outside), or its wall time when
    it returns None."""
    for _ in range(warmup):
        trial()
    samples = []
    for _ in range(max(1, trials)):
        started = time.perf_counter()
        own = trial()
        samples.append(own if own is not None else time.perf_counter() - started)
    return Timing.of(samples)


def timed(operation: Callable[[], T], device: torch.device | None = None) -> Timed[T]:
    """One run of `operation`, with the device synchronised before and after it: CUDA runs
    asynchronously, so without the syncs the clock would stop before the work is done."""
    _sync(device)
    started = time.perf_counter()
    value = operation()
    _sync(device)
    return Timed(time.perf_counter() - started, value)


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
