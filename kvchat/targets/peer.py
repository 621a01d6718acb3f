"""A command on a peer: another OpenAI-compatible engine at --connect (llama.cpp's
llama-server, vLLM, SGLang). Its sessions stay in this sessions dir, under its lock, and the
record of what this client sent it (`kvchat.client.ledger`) is kept beside them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from kvchat.errors import KvchatError
from kvchat.targets.base import BatchRunner, BatchSpec, OpenedChat

if TYPE_CHECKING:
    from rich.console import Console

    from kvchat.batch.peer import PeerRun
    from kvchat.client import Attachment
    from kvchat.client.openai_http import OpenAIClient
    from kvchat.client.peers import PeerInfo
    from kvchat.request_file import BatchItem

DEFAULT_CONCURRENCY = 4  # lines in flight on a peer that does not say how many slots it has


def detect_peer(server: Attachment) -> tuple[OpenAIClient, PeerInfo] | None:
    """For --connect: a client of the engine there and what it says it is; None for a kvchat
    server, whose own API (sessions, tree, pins) the commands use. Raises one paragraph when
    the URL is unreachable, not OpenAI-compatible, or refuses the key."""
    if not server.connect:
        return None
    from kvchat.client.openai_http import OpenAIClient
    from kvchat.client.peers import detect

    client = OpenAIClient(server.url, server.token, server.bounds)
    try:
        info = detect(client)
    except BaseException:
        client.close()
        raise
    if info.is_kvchat:
        client.close()
        return None
    return client, info


class Peer:
    """A peer engine, with the client `detect_peer` opened on it."""

    def __init__(self, client: OpenAIClient, info: PeerInfo, sessions_dir: Path) -> None:
        self.client, self.info = client, info
        self.sessions_dir = sessions_dir
        self.label = info.describe()

    @contextlib.contextmanager
    def chat(self, name: str | None, system: str | None, ui: Console) -> Iterator[OpenedChat]:
        from kvchat.chat.peer import PeerBackend
        from kvchat.chat.repl import next_session_name
        from kvchat.client.ledger import Ledger
        from kvchat.session_lock import sessions_lock
        from kvchat.sessions import SessionStore

        with self.client, sessions_lock(self.sessions_dir,
                                        f"kvchat chat --connect {self.info.url}"):
            store = SessionStore(self.sessions_dir)
            ledger = Ledger.open(self.sessions_dir, self.info.url, self.info.kind)
            backend = PeerBackend(self.client, self.info, store, ledger)
            session = store.open(name or next_session_name(store.names()))
            if system is not None:
                session.system = system
            yield OpenedChat(backend, session, store.history_file())

    @contextlib.contextmanager
    def batch(self, items: list[BatchItem], spec: BatchSpec,
              ui: Console) -> Iterator[BatchRunner]:
        """The lines in cache-aware order (or the file's), --concurrency at a time."""
        from kvchat.batch.peer import PeerRun
        from kvchat.client.ledger import Ledger
        from kvchat.session_lock import sessions_lock
        from kvchat.sessions import SessionStore

        if spec.pin_system:
            raise KvchatError(f"--pin-system pins in kvchat's own cache; {self.info.kind} keeps "
                              "its own, and its API has no way to pin a prefix.")
        ui.print(f"[dim]peer {escape(self.info.describe())} · model "
                 f"{escape(self.info.model)}[/dim]", soft_wrap=True)
        with self.client, sessions_lock(self.sessions_dir,
                                        f"kvchat batch --connect {self.info.url}"):
            store = SessionStore(self.sessions_dir)
            ledger = Ledger.open(self.sessions_dir, self.info.url, self.info.kind)
            concurrency = spec.concurrency or self.info.slots or DEFAULT_CONCURRENCY

            def start(update: Callable) -> PeerRun:  # type: ignore[type-arg]
                return PeerRun(self.client, self.info, items, spec.defaults, spec.fail_fast,
                               update, store, ledger, spec.order, concurrency)

            def save() -> None:
                try:
                    ledger.save()
                except KvchatError as exc:  # every row is written; only the record is not
                    ui.print(f"[yellow]{escape(str(exc))}[/yellow]")

            yield BatchRunner(start, lambda: None, save, None)
