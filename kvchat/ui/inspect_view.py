"""`kvchat inspect`'s text: the snapshot (or a server's live cache), both tiers, the radix
tree and the exact index; pure functions of plain data, like everything in `views`."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvchat.cache.stats import CacheStats
from kvchat.inspect.documents import ExactView, NodeView
from kvchat.inspect.previews import Decode, distinct_offsets, distinct_preview
from kvchat.ui.views import pool_panel, sessions_counters_table, tree_view


@dataclass(frozen=True)
class SnapshotFacts:
    path: str
    model: str
    dtype: str
    saved_at: float | None


def size(n_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n_bytes < 1024 or unit == "GiB":
            return f"{n_bytes:,.0f} {unit}" if unit == "B" else f"{n_bytes:,.1f} {unit}"
        n_bytes /= 1024
    raise AssertionError("unreachable")


def disk_line(disk: Mapping[str, Any], disk_tokens: int) -> str:
    """The disk tier beside the pool: its block files, their size against the budget, and the
    tokens of the tree that only the disk holds."""
    budget = int(disk.get("budget_bytes") or 0)
    of = f" of {size(budget)}" if budget else ""
    return (f"disk tier {int(disk['blocks']):,} blocks · {size(int(disk.get('bytes') or 0))}{of}"
            f" · {disk_tokens:,} tok only on disk (loaded back on a hit)")


def exact_table(entries: Sequence[ExactView], decode: Decode | None, limit: int = 10) -> Table:
    table = Table(box=box.SIMPLE_HEAD, title=f"exact index · {len(entries):,} entries",
                  title_justify="left")
    table.add_column("tokens", justify="right")
    table.add_column("blocks", justify="right")
    table.add_column("logits")
    table.add_column("what sets it apart")
    shared = distinct_offsets([e.tokens for e in entries])
    newest_first = list(reversed(list(zip(entries, shared, strict=True))))  # oldest are first
    for e, s in newest_first[:limit]:
        preview = e.preview if e.preview is not None else distinct_preview(e.tokens, s, decode,
                                                                          30)
        table.add_row(f"{e.n_tokens:,}", f"{e.blocks:,}", "yes" if e.has_logits else "no",
                      Text(preview))
    if len(entries) > limit:
        table.add_row("…", "", "", Text(f"{len(entries) - limit:,} more (--json lists all)"))
    return table


def inspect_view(
    facts: SnapshotFacts,
    stats: CacheStats,
    nodes: Sequence[NodeView],
    exact: Sequence[ExactView],
    decode: Decode | None,
    depth: int,
    max_children: int,
    session: str | None = None,
    disk: Mapping[str, Any] | None = None,
) -> RenderableType:
    """`kvchat inspect`'s text: the snapshot, both tiers (`disk`: the disk tier's files, as
    `tiers_json` gives them), the tree and the exact index."""
    when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(facts.saved_at))
            if facts.saved_at else "unknown")
    head = Text(
        f"snapshot {facts.path}\nsaved {when} · {facts.model} · {facts.dtype} · "
        f"block {stats.pool.block_size} tok"
    )
    if disk and disk.get("blocks") is not None:
        head.append(f"\n{disk_line(disk, stats.disk_tokens)}")
    if decode is None:
        head.append("\n(no tokenizer file recorded: previews show token ids)", style="dim")
    title = "radix tree" if session is None else f"radix tree (session {session})"
    parts: list[RenderableType] = [head, pool_panel(stats, "full")]
    if stats.sessions:
        parts.append(sessions_counters_table(stats))
    parts.append(tree_view(nodes, decode, depth, max_children, session, title))
    parts.append(exact_table(exact, decode))
    return Group(*parts)
