"""`kvchat verify`'s tables: cached runs against cold runs, token for token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich import box
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from kvchat.engine.verify import Fidelity, VerifyRow


def verify_table(rows: Sequence[VerifyRow]) -> Table:
    table = Table(box=box.SIMPLE_HEAD,
                  title="cached and batched vs cold, cold vs transformers (greedy)",
                  title_justify="left",
                  pad_edge=False, show_edge=False, collapse_padding=True)
    table.add_column("prompt", max_width=18, no_wrap=True, overflow="ellipsis")
    table.add_column("scenario", no_wrap=True)
    table.add_column("hit", justify="right", no_wrap=True)
    table.add_column("equal", no_wrap=True)
    table.add_column("diverges", justify="right", no_wrap=True)
    table.add_column("max |Δlogit|", justify="right", no_wrap=True)
    for r in rows:
        table.add_row(
            Text(r.prompt), r.scenario, f"{r.hit_tokens}/{r.prompt_tokens} {r.source}",
            Text("yes", style="green") if r.tokens_equal and r.ok
            else Text("tie", style="yellow") if r.ok else Text("NO", style="bold red"),
            "—" if r.first_divergence is None else str(r.first_divergence),
            f"{r.max_logit_diff:.1e}",
        )
    return table


def verify_summary(rows: Sequence[VerifyRow]) -> Text:
    bad = [r for r in rows if not r.ok]
    ties = [r for r in rows if r.ok and not r.tokens_equal]
    worst = max((r.max_logit_diff for r in rows), default=0.0)
    allowed = max((r.tolerance for r in rows), default=0.0)
    drafted = sum(r.draft_accepted for r in rows)
    limits = f"max |logit diff| {worst:.1e}, tolerance {allowed:.1e}"
    if drafted:
        limits += f"; {drafted:,} tokens came from cache drafts"
    if bad:
        return Text(f"{len(bad)} of {len(rows)} runs differ from their reference run "
                    f"({limits}).", style="bold red")
    if all(r.exact for r in rows):
        return Text(f"All {len(rows)} runs match their reference run bitwise, tokens and logits "
                    f"(the forward is batch-invariant here; {limits}).", style="green")
    if ties:
        return Text(f"All {len(rows)} runs match their reference run: {len(rows) - len(ties)} "
                    f"token for token, {len(ties)} up to a tie within the precision's rounding "
                    f"({limits}).", style="yellow")
    return Text(f"All {len(rows)} runs match their reference run token for token ({limits}).",
                style="green")


def fidelity_summary(rows: Sequence[Fidelity], precision: str) -> Text:
    """How many prompts' texts at `precision` equal the float32 model's own `generate`."""
    same = sum(r.equal for r in rows)
    text = Text(f"Fidelity: {same} of {len(rows)} texts at {precision} equal the float32 "
                "model's own generate", style="green" if same == len(rows) else "yellow")
    apart = [f"{r.prompt} at token {r.first_divergence}" for r in rows if not r.equal]
    if apart:
        text.append("; they part: " + ", ".join(apart), style="dim")
    return text.append(".")
