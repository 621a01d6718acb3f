"""Rich renderables for kvchat's terminal output: pure functions of plain data.

Everything the chat REPL prints is built here (`kvchat inspect`'s text is in `inspect_view`,
`kvchat verify`'s tables in `verify_view`), from the plain views in `kvchat.inspect.documents`
and small dataclasses; nothing here touches a model or torch, so each view is tested by
rendering it to text. Every view fits an 80-column terminal; the per-turn panels
come in three sizes (`/panels off|compact|full`), compact being one line per panel.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich import box
from rich.columns import Columns
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from kvchat.cache.stats import CacheStats, ratio
from kvchat.inspect.documents import NodeView, walk
from kvchat.inspect.previews import Decode, distinct_offsets, distinct_preview

if TYPE_CHECKING:
    from kvchat.engine.result import GenerationResult
    from kvchat.sessions import Turn

PANEL_MODES = ("off", "compact", "full")
BAR_WIDTH = 24


# ---- small formatting helpers --------------------------------------------------------------


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    fraction = max(0.0, min(1.0, fraction))
    filled = round(fraction * width)
    if 0 < fraction < 1:  # a little is never drawn as none, nearly all never as all
        filled = min(max(filled, 1), width - 1)
    return "█" * filled + "░" * (width - filled)


def pct(fraction: float) -> str:
    return f"{fraction * 100:.1f}%"


def ms(value: float) -> str:
    return f"{value:,.0f} ms" if value < 1000 else f"{value / 1000:,.2f} s"


def plural(n: int, noun: str) -> str:
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def printable(text: str) -> str:
    """Model output made safe for a terminal: control characters other than newline and tab are
    shown as their Unicode control pictures (␛, ␇, ...) instead of being executed."""
    out = []
    for ch in text:
        code = ord(ch)
        if ch in "\n\t":
            out.append(ch)
        elif code < 0x20:
            out.append(chr(0x2400 + code))
        elif code == 0x7F:
            out.append("␡")
        elif 0x80 <= code < 0xA0:
            out.append("�")
        else:
            out.append(ch)
    return "".join(out)


# ---- one chat turn -------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnView:
    number: int
    prompt_tokens: int
    hit_tokens: int
    source: str  # exact | radix | disk | miss
    ttft_ms: float
    prefill_ms: float
    completion_tokens: int
    decode_tokens_per_s: float
    finish_reason: str
    saved_ms: float | None  # estimated prefill time the hit tokens saved
    disk_hit_tokens: int = 0  # of hit_tokens, those loaded back from the disk tier
    miss: str = ""  # why the cached prefix ended where it did, when not a full hit
    miss_label: str = ""  # the reason as people read it: "new", "shared prefix", "cold", ...
    draft_tokens: int = 0  # reply tokens the cache proposed as drafts
    draft_accepted: int = 0  # of those, the ones verification kept
    replayed_tokens: int = 0  # reply tokens taken from a stored greedy reply, no forward

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens

    @property
    def hit_rate(self) -> float:
        return ratio(self.hit_tokens, self.prompt_tokens)


def turn_view(number: int, turn: Turn, result: GenerationResult, saved_ms: float | None
              ) -> TurnView:
    """The panels' view of a session's `number`th turn: its counts as the session recorded
    them, its times and the cache's story from the result."""
    explained = result.miss_reason not in ("", "hit", "off")
    return TurnView(
        number=number, prompt_tokens=turn.prompt_tokens, hit_tokens=turn.hit_tokens,
        source=turn.source, ttft_ms=result.ttft_ms, prefill_ms=result.prefill_ms,
        completion_tokens=turn.completion_tokens,
        decode_tokens_per_s=result.decode_tokens_per_s, finish_reason=turn.finish_reason,
        saved_ms=saved_ms, disk_hit_tokens=result.disk_hit_tokens,
        miss=result.miss_detail if explained else "", miss_label=result.miss_label,
        draft_tokens=result.draft_tokens, draft_accepted=result.draft_accepted,
        replayed_tokens=result.replayed_tokens)


RATE_MIN_TOKENS = 32  # shorter prefills measure mostly a forward pass's fixed cost


def prefill_rate(samples: Iterable[tuple[int, float]]) -> float | None:
    """Milliseconds per prompt token, from (computed tokens, prefill ms) of turns that ran a
    prefill: the fastest of those that computed at least RATE_MIN_TOKENS tokens (else of all).
    A prefill slowed by a busy moment says nothing about what the hit tokens would cost, and
    the fastest rate keeps the estimate of time saved from overstating it."""
    timed = [(n, t) for n, t in samples if n > 0 and t > 0]
    long_enough = [(n, t) for n, t in timed if n >= RATE_MIN_TOKENS] or timed
    return min((t / n for n, t in long_enough), default=None)


def estimate_saved_ms(hit_tokens: int, rate: float | None) -> float | None:
    return None if rate is None else hit_tokens * rate


def _saved(turn: TurnView) -> str:
    return "saved —" if turn.saved_ms is None else f"saved ≈ {ms(turn.saved_ms)} est."


def hit_panel(turn: TurnView, mode: str = "full") -> RenderableType:
    """This turn's prompt: how much came from the cache and what that saved."""
    t = turn
    if mode == "compact":
        return Text(
            f"turn {t.number} · {t.hit_tokens:,}/{t.prompt_tokens:,} cached {pct(t.hit_rate)} "
            f"{t.source} · TTFT {ms(t.ttft_ms)} · {_saved(t)}"
        )
    lines = [
        f"cached {t.hit_tokens:,} / {t.prompt_tokens:,} tok  {pct(t.hit_rate)}",
        f"{bar(t.hit_rate)} {t.source}",
        f"computed {t.computed_tokens:,} tok · prefill {ms(t.prefill_ms)}",
        f"TTFT {ms(t.ttft_ms)} · {_saved(t)}",
        f"reply {t.completion_tokens:,} tok · "
        + ("replayed" if t.replayed_tokens else f"{t.decode_tokens_per_s:,.0f} tok/s")
        + f" · {t.finish_reason}",
    ]
    if t.replayed_tokens:  # an exact greedy repeat: the stored reply, no forward
        lines.insert(5, f"replayed {t.replayed_tokens:,} reply tok from the cache: no forward")
    elif t.draft_tokens:  # the reply was (partly) drafted from the cache's copy of it
        lines.insert(5, f"drafted {t.draft_accepted:,} of {t.completion_tokens:,} reply tok "
                     f"from the cache ({t.draft_tokens:,} proposed)")
    disk = t.disk_hit_tokens
    if disk:  # the hit came (partly) from the disk tier: say how much
        lines.insert(2, f"memory {t.hit_tokens - disk:,} tok · disk {disk:,} tok")
    if t.miss_label == "new":  # ordinary: the history was cached, the new message is not
        lines.append(f"new {t.computed_tokens:,} tok: this turn's message, not seen before")
    elif t.miss_label == "shared prefix":
        lines.append(f"shared prefix {t.hit_tokens:,} tok, as earlier conversations began; "
                     "then new")
    elif t.miss:
        lines.append(f"why {t.miss}")
    return Panel(
        Text("\n".join(lines)), title=f"turn {t.number} · cache", title_align="left",
        expand=False,
    )


def pool_panel(stats: CacheStats, mode: str = "full") -> RenderableType:
    """Occupancy of the block pool and the cache's overall hit rate."""
    s, pool = stats, stats.pool
    if pool.total_blocks is None or pool.free_blocks is None:
        used = f"{pool.used_blocks:,} blocks (pool size not recorded)"
        free = "free ?"
    else:
        used = (f"{pool.used_blocks:,} / {pool.total_blocks:,} blocks · "
                f"{pct(pool.utilisation or 0.0)}")
        free = f"free {pool.free_blocks:,}"
    if mode == "compact":
        util = "" if pool.utilisation is None else f" {pct(pool.utilisation)}"
        total = "?" if pool.total_blocks is None else f"{pool.total_blocks:,}"
        return Text(
            f"pool {pool.used_blocks:,}/{total} blk{util} · {s.eviction_count:,} evicted · "
            f"hit rate {pct(s.hit_rate)} · {s.tree_tokens:,} tok cached"
        )
    lines = [
        f"used {used}",
        bar(pool.utilisation or 0.0),
        f"{free} · evictions {s.eviction_count:,}",
        f"hit rate {pct(s.hit_rate)} ({pct(s.token_hit_rate)} of tokens)",
        f"cached {s.tree_tokens:,} tok in {plural(s.tree_nodes, 'node')}"
        + (f" · {s.disk_tokens:,} on disk" if s.disk_tokens else ""),
    ]
    return Panel(
        Text("\n".join(lines)), title=f"block pool · {s.policy}", title_align="left",
        expand=False,
    )


# ---- the radix tree ------------------------------------------------------------------------


def _owners(owners: Sequence[str], limit: int = 2) -> str:
    if not owners:
        return ""
    shown = ", ".join(owners[:limit])
    return shown + (f" +{len(owners) - limit}" if len(owners) > limit else "")


def blocks_label(node: NodeView) -> str:
    """A node's blocks by tier: "3 blk", "2 blk on disk", "1 blk + 2 on disk"."""
    if not node.disk_blocks:
        return f"{node.blocks:,} blk"
    if not node.blocks:
        return f"{node.disk_blocks:,} blk on disk"
    return f"{node.blocks:,} blk + {node.disk_blocks:,} on disk"


def node_label(
    node: NodeView, decode: Decode | None, highlight: str | None = None, shared: int = 0
) -> Text:
    """Counts, then a preview of the edge's text after the `shared` tokens it has in common
    with a sibling (siblings can share the head of the block they branch in)."""
    label = Text(f"{node.n_tokens:,} tok · {blocks_label(node)} · ref {node.max_ref} ")
    if node.pinned:
        label.append("pinned ", style="bold magenta")
    label.append(f'"{distinct_preview(node.tokens, shared, decode)}"', style="cyan")
    owners = _owners(node.owners)
    if owners:
        label.append(f" {owners}", style="bold" if highlight in node.owners else "dim")
    return label


def tree_view(
    nodes: Sequence[NodeView],
    decode: Decode | None,
    depth: int = 3,
    max_children: int = 3,
    highlight: str | None = None,
    title: str | None = None,
) -> Tree:
    """The radix tree, `depth` levels deep, at most `max_children` siblings per node (the
    highlighted session's branches first); what is left out is counted, never silently dropped."""
    all_nodes = list(walk(nodes))
    head = title or "radix tree"
    root = Tree(Text(f"{head} · {plural(len(all_nodes), 'node')} · "
                     f"{sum(n.n_tokens for n in all_nodes):,} tok"))
    if not nodes:
        root.add(Text("(empty)", style="dim"))
        return root

    def first(group: Sequence[NodeView]) -> list[NodeView]:
        if highlight is None:
            return list(group)
        return sorted(group, key=lambda n: highlight not in n.owners)  # stable

    stack: list[tuple[Tree, Sequence[NodeView], int]] = [(root, nodes, 1)]
    while stack:
        parent, group, level = stack.pop()
        ordered = first(group)
        shared = dict(zip(map(id, ordered), distinct_offsets([n.tokens for n in ordered]),
                          strict=True))
        for node in ordered[:max_children]:
            branch = parent.add(node_label(node, decode, highlight, shared[id(node)]))
            if not node.children:
                continue
            if level < depth:
                stack.append((branch, node.children, level + 1))
            else:
                hidden = node.descendants()
                branch.add(Text(f"… {hidden:,} more below", style="dim"))
        if len(ordered) > max_children:
            parent.add(Text(f"… {len(ordered) - max_children:,} more", style="dim"))
    return root


def tree_panel(
    nodes: Sequence[NodeView],
    decode: Decode | None,
    mode: str = "full",
    highlight: str | None = None,
    depth: int = 3,
    max_children: int = 3,
) -> RenderableType:
    if mode == "compact":
        all_nodes = list(walk(nodes))
        line = f"tree {plural(len(all_nodes), 'node')} · {sum(n.n_tokens for n in all_nodes):,} tok"
        if highlight is not None:
            mine = [n for n in all_nodes if highlight in n.owners]
            line += (f" · {highlight}: {sum(n.n_tokens for n in mine):,} tok in "
                     f"{plural(len(mine), 'node')}")
        return Text(line)
    return tree_view(nodes, decode, depth, max_children, highlight)


def turn_panels(
    turn: TurnView,
    stats: CacheStats,
    nodes: Sequence[NodeView],
    decode: Decode | None,
    mode: str = "full",
    highlight: str | None = None,
) -> RenderableType:
    """What the REPL prints after a reply."""
    if mode == "off":
        return Group()
    hit, pool = hit_panel(turn, mode), pool_panel(stats, mode)
    tree = tree_panel(nodes, decode, mode, highlight)
    if mode == "compact":
        return Group(hit, pool, tree)
    return Group(Columns([hit, pool]), tree)


# ---- REPL screens --------------------------------------------------------------------------


def banner(lines: Sequence[str]) -> RenderableType:
    return Panel(Text("\n".join(lines)), title="kvchat chat", title_align="left", expand=False)


def help_view(commands: Sequence[tuple[str, str]], keys: Sequence[tuple[str, str]]) -> Table:
    table = Table(box=box.SIMPLE, show_header=False, pad_edge=False)
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("does")
    for usage, text in commands:
        table.add_row(usage, text)
    table.add_section()
    for key, text in keys:
        table.add_row(key, text)
    return table


def turns_table(turns: Sequence[Turn], last: int = 10) -> Table:
    """A session's recent turns: what each prompt found in the cache."""
    shown = list(enumerate(turns, 1))[-last:]
    table = Table(box=box.SIMPLE_HEAD, title="this session's turns", title_justify="left")
    for name in ("#", "prompt", "cached", "rate", "source", "TTFT", "reply", "end"):
        table.add_column(name, justify="left" if name in ("source", "end") else "right")
    for i, t in shown:
        table.add_row(
            str(i), f"{t.prompt_tokens:,}", f"{t.hit_tokens:,}", pct(t.hit_rate), t.source,
            ms(t.ttft_ms), f"{t.completion_tokens:,}", t.finish_reason,
        )
    return table


def sessions_counters_table(stats: CacheStats) -> Table:
    table = Table(box=box.SIMPLE_HEAD, title="per session (cache lookups)", title_justify="left")
    for name in ("session", "lookups", "hits", "prompt tok", "cached tok", "rate"):
        table.add_column(name, justify="left" if name == "session" else "right")
    for sid, c in sorted(stats.sessions.items()):
        table.add_row(sid, f"{c.lookups:,}", f"{c.hits:,}", f"{c.prompt_tokens:,}",
                      f"{c.hit_tokens:,}", pct(c.hit_rate))
    return table


def stats_view(stats: CacheStats, turns: Sequence[Turn], integrity: str) -> RenderableType:
    s = stats
    facts = Text(
        f"exact index {s.exact_entries:,} entries · {s.exact_hits:,} exact hits · "
        f"{s.stored_tokens:,} tok stored · integrity {integrity}"
    )
    parts: list[RenderableType] = [pool_panel(s, "full"), facts]
    if s.sessions:
        parts.append(sessions_counters_table(s))
    if turns:
        parts.append(turns_table(turns))
    return Group(*parts)


@dataclass(frozen=True)
class SessionRow:
    name: str
    turns: int
    updated: float
    current: bool


def sessions_table(rows: Sequence[SessionRow]) -> RenderableType:
    if not rows:
        return Text("No saved sessions yet.")
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("")
    table.add_column("session")
    table.add_column("turns", justify="right")
    table.add_column("last used")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.updated))
        table.add_row("*" if r.current else "", r.name, str(r.turns), when)
    return table
