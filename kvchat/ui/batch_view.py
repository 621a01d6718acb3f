"""Rich views for `kvchat batch`: the live progress line and the closing summary table."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from kvchat.cache.stats import ratio

if TYPE_CHECKING:
    from kvchat.batch import BatchProgress, ItemResult
    from kvchat.cache.stats import CacheStats


def batch_progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]batch[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def progress_rate(p: BatchProgress | None, bad: int = 0) -> str:
    """Tokens per second, hit rate and failures so far; `bad`: the file's unreadable lines,
    failed before the run starts (the summary counts them the same way)."""
    failed = (p.failed if p is not None else 0) + bad
    note = f" · [red]{failed} failed[/red]" if failed else ""
    if p is None:
        return note.removeprefix(" · ")
    elapsed = max(time.perf_counter() - p.started, 1e-9)
    return f"{p.completion_tokens / elapsed:,.1f} tok/s · hit rate {p.hit_rate:.0%}{note}"


def estimated_saving_ms(results: Sequence[ItemResult]) -> float | None:
    """Prefill time the hits saved, at the prefill speed this run measured on its misses
    (requests that computed at least 32 prompt tokens)."""
    done = [r.result for r in results if r.result is not None]
    timed = [r for r in done if r.computed_tokens >= 32 and r.prefill_ms > 0]
    if not timed:
        return None
    per_token = sum(r.prefill_ms for r in timed) / sum(r.computed_tokens for r in timed)
    return per_token * sum(r.cache_hit_tokens for r in done)


def _saving(saved: float | None, done: Sequence[Any], hits: int) -> str:
    """The saving, or why there is none to say: timed on this run's own misses."""
    if saved is not None:
        return f"{saved / 1000:,.1f} s"
    if not hits:
        return "–"
    if any(r.computed_tokens >= 32 for r in done):
        return "– (the engine reports no prefill time)"
    return "– (no miss of 32+ tokens to time)"


def max_tokens_note(default: int, own: Sequence[int | None]) -> str:
    """How long the replies were allowed to be: --max-tokens, and the lines whose own
    max_tokens won over it, said plainly so that nothing is overridden silently."""
    given = sorted(n for n in own if n is not None)
    if not given:
        return f"{default:,} (--max-tokens)"
    values = f"{given[0]:,}" if given[0] == given[-1] else f"{given[0]:,}–{given[-1]:,}"
    rest = len(own) - len(given)
    head = f"{default:,} (--max-tokens) for {rest:,} line(s); " if rest else ""
    return f"{head}{len(given):,} line(s) set their own, which wins: {values}"


def summary_table(
    p: BatchProgress, results: Sequence[ItemResult], parse_errors: int, stats: CacheStats | None,
    wall_s: float, batch_size: str | None = None, max_tokens: str | None = None,
    behind: Mapping[str, str] | None = None,
    extra: Sequence[tuple[str, str]] = (),
    unrecorded: int = 0,
) -> Table:
    """`unrecorded`: lines a stopped run left without a result (each has a "not started"
    row)."""
    done = [r.result for r in results if r.result is not None]
    prompt = sum(r.prompt_tokens for r in done)
    hits = sum(r.cache_hit_tokens for r in done)
    computed = sum(r.computed_tokens for r in done)
    saved = estimated_saving_ms(results)
    t = Table(title="kvchat batch", box=box.SIMPLE_HEAD, show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value", justify="right")
    stopped = [f"{p.cut_short} cut short"] if p.cut_short else []
    unrun = p.not_started + unrecorded
    stopped += [f"{unrun} not started"] if unrun else []
    t.add_row("requests", ", ".join([f"{p.finished} finished",
                                     f"{p.failed + parse_errors} failed", *stopped]))
    t.add_row("prompt tokens", f"{prompt:,}")
    t.add_row("hit tokens", f"{hits:,}")
    t.add_row("hit rate", f"{ratio(hits, prompt):.1%}" if prompt else "–")
    t.add_row("prefill computed / total", f"{computed:,} / {prompt:,}")
    t.add_row("completion tokens", f"{sum(r.completion_tokens for r in done):,}")
    # exact greedy repeats that ended on a stored reply (a peer engine's replies say nothing)
    replayed = [n for r in done if (n := getattr(r, "replayed_tokens", 0))]
    if replayed:
        tokens = sum(replayed)
        t.add_row("replies replayed", f"{len(replayed):,} ({tokens:,} tok, no forward)")
    t.add_row("prefill time saved (est.)", _saving(saved, done, hits))
    t.add_row("wall time", f"{wall_s:,.1f} s")
    if batch_size is not None:
        t.add_row("batch size", batch_size)
    if max_tokens is not None:
        t.add_row("max tokens", max_tokens)
    if behind:  # session files a failed save left behind the rows
        t.add_row("sessions behind", Text(", ".join(f"{name} ({how})"
                                                    for name, how in behind.items()),
                                          style="yellow"))
    for what, value in extra:  # a remote engine: which, in what order, how it reported
        t.add_row(what, value)
    if stats is not None:
        t.add_row("evictions", f"{stats.eviction_count:,}")
        pool = stats.pool
        t.add_row("pool", f"{pool.used_blocks:,}/{pool.total_blocks or 0:,} blocks "
                          f"({pool.utilisation or 0.0:.0%})")
    return t
