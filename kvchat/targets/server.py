"""A command on a running kvchat server (the one holding the sessions dir, or at --connect): its
model, cache and sessions, shared with everything else it serves."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from kvchat.client import Attachment, Client, ServerError, ServerGone
from kvchat.targets.base import BatchRunner, BatchSpec, OpenedChat

if TYPE_CHECKING:
    from rich.console import Console

    from kvchat.batch.attached import AttachedRun
    from kvchat.cache.stats import CacheStats
    from kvchat.request_file import BatchItem


def server_stats(client: Client) -> CacheStats | None:
    """The server's cache stats for the summary, or None when it cannot say."""
    from kvchat.client.documents import stats_from_document

    try:
        return stats_from_document(client.cache_stats())
    except (ServerError, ServerGone, KeyError, ValueError, TypeError):
        return None


class Server:
    """A kvchat server, as `attachment` found it."""

    def __init__(self, server: Attachment, sessions_dir: Path) -> None:
        self.server = server
        self.sessions_dir = sessions_dir
        self.label = f"{server.found} at {server.url}"

    @contextlib.contextmanager
    def chat(self, name: str | None, system: str | None, ui: Console) -> Iterator[OpenedChat]:
        from kvchat.chat.repl import next_session_name
        from kvchat.chat.server import ServerBackend
        from kvchat.sessions import SessionStore

        with self.server.client() as client:
            backend = ServerBackend(client, self.server.found)
            session = backend.sessions.open(name or next_session_name(backend.sessions.names()))
            if system is not None:
                session.system = system
            yield OpenedChat(backend, session, SessionStore(self.sessions_dir).history_file())

    @contextlib.contextmanager
    def batch(self, items: list[BatchItem], spec: BatchSpec,
              ui: Console) -> Iterator[BatchRunner]:
        """The server batches the lines with whatever else it runs and saves its own cache."""
        from kvchat.batch.attached import AttachedRun

        ui.print(f"[dim]attached to {escape(self.server.found)} at "
                 f"{escape(self.server.url)}[/dim]")
        with self.server.client() as client:
            client.health()  # a server that is gone says so before any row is written

            def start(update: Callable) -> AttachedRun:  # type: ignore[type-arg]
                return AttachedRun(client, items, spec.defaults, spec.fail_fast, update,
                                   spec.pin_system, spec.concurrency)

            def stats() -> CacheStats | None:
                with self.server.client() as fresh:  # the run's client may be closed
                    return server_stats(fresh)

            yield BatchRunner(start, stats, lambda: None, "the server's")
