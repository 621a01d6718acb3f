"""`kvchat batch` attached to a running server (the run itself: `kvchat.batch.attached`): where
it is, and its cache stats for the summary."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from kvchat.client import Attachment, Client, ServerError, ServerGone

if TYPE_CHECKING:
    from kvchat.cache.stats import CacheStats


def server_stats(client: Client) -> CacheStats | None:
    """The server's cache stats for the summary, or None when it cannot say."""
    from kvchat.client.documents import stats_from_document

    try:
        return stats_from_document(client.cache_stats())
    except (ServerError, ServerGone, KeyError, ValueError, TypeError):
        return None


def describe(server: Attachment, ui: Console) -> None:
    ui.print(f"[dim]attached to {escape(server.found)} at {escape(server.url)}[/dim]")

