"""The `kvchat inspect --explain` panel: a pure function of a PromptExplanation."""

from __future__ import annotations

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvchat.cache.explain import MissReason
from kvchat.inspect.explain import PromptExplanation
from kvchat.ui.views import bar, pct, printable

_STYLE = {MissReason.HIT: "green", MissReason.COLD: "cyan", MissReason.EVICTED: "yellow",
          MissReason.DIVERGED: "magenta", MissReason.POOL_FULL: "red"}


def _shown(text: str) -> str:
    """Decoded tokens on one line: newlines as ⏎ so both sides of a divergence line up."""
    return printable(text.replace("\n", "⏎").replace("\t", "⇥"))


def explain_panel(result: PromptExplanation, source: str) -> RenderableType:
    """Cached tokens against prompt tokens, the reason, and for a divergence the text on each
    side (cached vs new); for an eviction, when and by which policy."""
    why, d = result.explanation, result.detail
    n = why.prompt_tokens
    share = why.cached / n if n else 0.0
    table = Table(box=box.SIMPLE, show_header=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("cached", f"{why.cached:,} / {n:,} tok  {pct(share)}  {bar(share)}")
    table.add_row("reason", Text(why.reason.value, style=_STYLE[why.reason]))
    if why.reason is MissReason.DIVERGED:
        table.add_row("at token", f"{why.diverged_at:,}")
        before = _shown(d.get("before", ""))
        theirs = d.get("cached")
        table.add_row("cached", Text.assemble(("…" + before, "dim"),
                                              (_shown(theirs), "green") if theirs is not None
                                              else ("(not shown: others write here too)",
                                                    "dim italic")))
        table.add_row("new", Text.assemble(("…" + before, "dim"),
                                           (_shown(d.get("new", "")), "red")))
    elif why.reason is MissReason.EVICTED:
        table.add_row("evicted", f"tokens {why.cached:,}-{why.evicted_through:,} "
                                 f"({d.get('evicted_tokens', 0):,} tok)")
        table.add_row("by", f"{why.evicted_by} at {d.get('evicted_at_local', '?')}")
        table.add_row("text", Text(_shown(d.get("evicted_text", "")), style="yellow"))
    elif why.reason is MissReason.COLD and why.cached:
        table.add_row("ends after", Text(_shown(d.get("before", "")), style="dim"))
    return Panel(Group(Text(result.line), table), title=f"why · {source}", title_align="left",
                 expand=False)
