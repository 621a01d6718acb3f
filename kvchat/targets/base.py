"""What every target offers, whatever runs the command: a chat backend with its session, and a
batch runner, both taking the same typed defaults (`SamplingParams`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

from kvchat.batch.order import ORDERS
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from rich.console import Console

    from kvchat.batch import ItemResult, LineRun
    from kvchat.cache.stats import CacheStats
    from kvchat.chat.backend import ChatBackend
    from kvchat.config import SamplingParams
    from kvchat.request_file import BatchItem
    from kvchat.sessions import Session


@dataclass(frozen=True)
class BatchSpec:
    """How a batch file runs, wherever it runs: the defaults a line leaves to the command,
    --fail-fast, --pin-system, --batch-size (None: auto), and for a peer --order and
    --concurrency (None: what the target says)."""

    defaults: SamplingParams
    fail_fast: bool = False
    pin_system: bool = False
    batch_size: int | None = None
    order: str = "cache-aware"
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise KvchatError(f"--order must be one of {', '.join(ORDERS)}, got "
                              f"{self.order!r}.")


class BatchRunner(NamedTuple):
    """A target's batch: `start(update)` makes the run (`update` gets each result as it is
    in), `stats()` the cache's counters for the summary (None: the target cannot say),
    `save()` runs however the run ends, `size` says how the batch size was chosen."""

    start: Callable[[Callable[[ItemResult], None]], LineRun]
    stats: Callable[[], CacheStats | None]
    save: Callable[[], None]
    size: str | None


class OpenedChat(NamedTuple):
    """A chat ready to run: its backend, the session it continues, the REPL's history file."""

    backend: ChatBackend
    session: Session
    history_file: Path


class Target(Protocol):
    """Where a command runs: this process, a kvchat server, or a peer engine."""

    label: str  # for the banner, the summary and error messages

    def chat(self, name: str | None, system: str | None,
             ui: Console) -> AbstractContextManager[OpenedChat]:
        """The session `name` (None: a new one) opened for a chat, with `system` set when
        given; held (lock, connection, loaded model) until the block ends."""
        ...

    def batch(self, items: list[BatchItem], spec: BatchSpec,
              ui: Console) -> AbstractContextManager[BatchRunner]:
        """The batch runner for `items`, held until the block ends."""
        ...
