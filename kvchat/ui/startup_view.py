"""What a command's start waited on: each stage (import, load, compile, restore) and its time."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text


def startup_line(stages: Sequence[tuple[str, float]]) -> Text:
    """`ready in 6.2 s: import 2.9 s · load 2.8 s · restore 0.5 s`, dim."""
    total = sum(seconds for _, seconds in stages)
    parts = " · ".join(f"{name} {seconds:.1f} s" for name, seconds in stages)
    return Text(f"ready in {total:.1f} s: {parts}", style="dim")


def listening_line(url: str, host: str) -> Text:
    """Where `kvchat serve` answers: its URL, the OpenAI base URL, and how to stop it."""
    everywhere = " (bound to every interface: other machines use this one's address)" \
        if host in ("0.0.0.0", "::") else ""
    return Text.assemble(("kvchat serve listening on ", "bold"), (url, "bold cyan"),
                         f"{everywhere} · OpenAI base URL {url}/v1 · Ctrl-C or `kvchat stop` "
                         "stops it")
