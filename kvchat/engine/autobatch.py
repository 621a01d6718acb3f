"""`--batch-size auto`: how many sequences to decode together on this model and device.

A decode step is bound by reading the weights, so on most devices it costs nearly the same for
1 row or for many, until the batch's K/V and activations catch up. kvchat measures one decode
step at the batch sizes a run can use (once per model and device: what was measured is kept in
the kvchat cache dir, and a later run measures only sizes nobody measured yet), takes the
smallest size within 10% of the best throughput measured (one noisy point on a busy machine
cannot stop the search early), and bounds it so that every row's K/V fits in the pool's budget.

A step never gets cheaper with more rows, so a sweep in which fewer rows took clearly longer
than more rows was disturbed (a busy machine): it is measured again, up to ROUNDS sweeps, each
size keeping its fastest time. One still noisy is kept, marked so, and measured again only by a
run long enough that measuring is a small part of it (REFINE): a second run of a small file
measures nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvchat.engine.model_runner import ModelRunner
from kvchat.engine.past import past_kv, wrap_past

SIZES = (1, 2, 4, 8, 16, 32, 64)
NEAR_BEST = 0.90  # the smallest size reaching this share of the best tokens per second
CONTEXT = 64  # tokens of context per row while measuring
NOISE = 1.3  # fewer rows measured this much slower than more rows: the sweep was disturbed
ROUNDS = 3  # sweeps at most, until one is not noisy
REFINE = 20  # a noisy kept sweep is measured again by a run with this many times its cost
MEASURING = ("Measuring decode steps at {sizes} rows for --batch-size auto (once per model and "
             "device)…")
Status = Callable[[str], AbstractContextManager[Any]]


@dataclass(frozen=True)
class BatchChoice:
    size: int
    measured: dict[int, float]  # batch size -> seconds per decode step
    best: int  # the size the measurement alone picks
    bound: int  # the most rows whose K/V fit the pool budget
    reused: bool  # the measurement came from the cache dir
    noisy: bool = False  # still noisy after ROUNDS sweeps: used for this run, not kept

    def describe(self) -> str:
        source = "measured earlier" if self.reused else "measured now"
        if self.noisy:
            source += ", noisy: kept, measured again by a long run"
        limit = f", bounded by the pool to {self.bound}" if self.bound < self.best else ""
        return f"{self.size} (auto: {source}{limit})"


def noisy(measured: dict[int, float]) -> bool:
    """A sweep in which some batch size took NOISE times longer than a larger one."""
    sizes = sorted(measured)
    return any(measured[small] > NOISE * measured[big]
               for i, small in enumerate(sizes) for big in sizes[i + 1:])


def measure_settled(runner: ModelRunner, sizes: tuple[int, ...] = SIZES
                    ) -> tuple[dict[int, float], bool]:
    """Sweeps until the step times are consistent (at most ROUNDS), each size keeping its
    fastest time; returns them and whether they are still noisy."""
    best: dict[int, float] = {}
    for _ in range(ROUNDS):
        sweep = measure_steps(runner, sizes)
        best = {size: min(best.get(size, seconds), seconds) for size, seconds in sweep.items()}
        if not noisy(best):
            return best, False
    return best, True


def measure_steps(runner: ModelRunner, sizes: tuple[int, ...] = SIZES,
                  repeats: int = 3) -> dict[int, float]:
    """Fastest seconds of one decode forward for each batch size, after CONTEXT tokens (the
    fastest of a few: a disturbance only ever adds time)."""
    ids = torch.randint(3, 200, (1, CONTEXT), device=runner.device)
    with torch.inference_mode():
        past = runner.past()
        runner.model(input_ids=ids, past_key_values=past, use_cache=True, logits_to_keep=1)
        kv = past_kv(past, 0, CONTEXT)
        out: dict[int, float] = {}
        for size in sizes:
            rows = [(k.expand(size, -1, -1, -1).contiguous(),
                     v.expand(size, -1, -1, -1).contiguous()) for k, v in kv]
            step = ids[:, -1:].expand(size, 1).contiguous()
            times = []
            for _ in range(repeats):
                batch = wrap_past([(k.clone(), v.clone()) for k, v in rows], runner.config)
                started = time.perf_counter()
                runner.model(input_ids=step, past_key_values=batch, use_cache=True,
                             logits_to_keep=1)
                times.append(time.perf_counter() - started)
            out[size] = min(times)
    return out


def best_size(measured: dict[int, float]) -> int:
    """The smallest batch size whose tokens per second reach NEAR_BEST of the best measured:
    past it, more rows add latency and memory for little throughput."""
    throughput = {size: size / seconds for size, seconds in measured.items()}
    top = max(throughput.values())
    return min(size for size, rate in throughput.items() if rate >= NEAR_BEST * top)


def choose_batch_size(runner: ModelRunner, key: str, remember: Path | None,
                      pool_tokens: int, seq_tokens: int, status: Status | None = None,
                      rows: int | None = None, work_steps: int | None = None) -> BatchChoice:
    """The batch size for this model and device, bounded so that `size` rows of `seq_tokens`
    tokens each fit in `pool_tokens`. `status(message)` is shown while measuring (a spinner).

    What is measured is kept in `remember` and reused: a run measures only the sizes it can
    use and nobody measured yet (`rows`: the most rows it can decode at once; None: any), so a
    small file's first run measures little and its second run nothing. A sweep that stayed
    noisy is kept too (each size's fastest time: a busy machine only ever adds time) and
    measured again only by a run whose decode work (`work_steps`, row-steps) is REFINE times
    what measuring costs."""
    saved = _load(remember)
    entry = saved.get(key, {})
    steps = entry.get("steps", entry) if isinstance(entry, dict) else {}
    try:
        measured = {int(k): float(v) for k, v in steps.items()}
    except (TypeError, ValueError, AttributeError):
        measured = {}
    was_noisy = bool(entry.get("noisy", noisy(measured))) if isinstance(entry, dict) else False
    wanted = usable_sizes(rows)
    missing = tuple(size for size in wanted if size not in measured)
    if was_noisy and (work_steps is None or work_steps >= REFINE * measure_cost(wanted)):
        missing = wanted  # a long run (or one of unknown length) measures a noisy sweep again
    reused = not missing
    if missing:
        with (status or _quiet)(measuring(missing)):
            fresh, still_noisy = measure_settled(runner, missing)
        measured = {**measured, **fresh}
        was_noisy = still_noisy or (was_noisy and set(missing) != set(wanted))
        if remember is not None:
            saved[key] = {"steps": {str(k): v for k, v in sorted(measured.items())},
                          "noisy": was_noisy}
            _save(remember, saved)
    usable = {size: t for size, t in measured.items() if size in wanted} or measured
    best = best_size(usable)
    bound = max(1, pool_tokens // max(1, min(seq_tokens, runner.max_context)))
    return BatchChoice(min(best, bound), measured, best, bound, reused, was_noisy)


def measuring(sizes: tuple[int, ...]) -> str:
    """The spinner's message while `sizes` are measured."""
    shown = f"{sizes[0]} to {sizes[-1]}" if len(sizes) > 1 else str(sizes[0])
    return MEASURING.format(sizes=shown)


def usable_sizes(rows: int | None) -> tuple[int, ...]:
    """The sizes worth measuring for a run of at most `rows` rows at once: up to the first
    size that holds them all (None: every size)."""
    if rows is None:
        return SIZES
    top = next((size for size in SIZES if size >= rows), SIZES[-1])
    return tuple(size for size in SIZES if size <= top)


def measure_cost(sizes: tuple[int, ...], repeats: int = 3) -> int:
    """Row-steps a sweep of `sizes` costs at most (ROUNDS sweeps of `repeats` each)."""
    return ROUNDS * repeats * sum(sizes)


def _quiet(message: str) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


def _load(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save(path: Path, data: dict[str, Any]) -> None:
    """Best effort: a cache dir that cannot be written only means measuring again next time."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
