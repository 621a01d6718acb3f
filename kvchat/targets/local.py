"""A command in this process: the model loads here, under the sessions dir's lock (a second
chat or batch on the same folder is refused before anything loads)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from kvchat.errors import KvchatError
from kvchat.targets.base import BatchRunner, BatchSpec, OpenedChat

IMPORTING = "importing torch and transformers…"

if TYPE_CHECKING:
    from rich.console import Console
    from rich.status import Status

    from kvchat.request_file import BatchItem
    from kvchat.runtime import Runtime, RuntimeOptions


class StartupClock:
    """The stages of a start and the time each took; each stage's name is said on the status
    line as it begins."""

    def __init__(self, status: Status) -> None:
        self.status = status
        self.stages: list[tuple[str, float]] = []
        self._current: tuple[str, float] | None = None

    def __call__(self, name: str, what: str) -> None:
        self.stop()
        self._current = (name, time.perf_counter())
        self.status.update(f"{what}…")

    def stop(self) -> list[tuple[str, float]]:
        if self._current is not None:
            name, began = self._current
            self.stages.append((name, time.perf_counter() - began))
            self._current = None
        return self.stages


def open_runtime(build: Callable[[], RuntimeOptions], ui: Console,
                 imported: float = 0.0) -> Runtime:
    """The model, engine and cache of this sessions dir, loaded here, a status line saying from
    the first moment what the start waits on (import, load, compile, restore), and then the
    time each took. The one place a command opens a runtime. `imported`: seconds the command
    already spent importing torch under `importing()`, counted in the import stage."""
    from kvchat.ui.startup_view import startup_line

    with ui.status(IMPORTING) as status:
        clock = StartupClock(status)
        clock("import", IMPORTING.removesuffix("…"))
        options = build()
        from kvchat.runtime import Runtime

        runtime = Runtime.open(options, clock)
        stages = clock.stop()
    if imported and stages and stages[0][0] == "import":
        stages[0] = ("import", stages[0][1] + imported)
    ui.print(startup_line(stages))
    return runtime


@contextlib.contextmanager
def importing(ui: Console) -> Iterator[Callable[[], float]]:
    """A status line while a command imports what pulls in torch before `open_runtime`; yields
    a function giving the seconds it took, for `open_runtime(imported=...)`."""
    began = time.perf_counter()
    took: list[float] = []
    with ui.status(IMPORTING):
        yield lambda: took[0] if took else time.perf_counter() - began
    took.append(time.perf_counter() - began)


def close_runtime(runtime: Runtime, ui: Console) -> None:
    """The disk tier's queued blocks reach the disk; what went wrong on the way is said."""
    runtime.close()
    for notice in runtime.take_notices():
        ui.print(f"[yellow]{escape(notice)}[/yellow]")


class Local:
    """This process: `build()` makes the runtime options (importing torch) only when a command
    runs here."""

    label = "this process"

    def __init__(self, sessions_dir: Path, build: Callable[[], RuntimeOptions] | None) -> None:
        self.sessions_dir = sessions_dir
        self._build = build

    def build(self) -> RuntimeOptions:
        if self._build is None:
            raise KvchatError("This command does not load a model in this process.")
        return self._build()

    @contextlib.contextmanager
    def chat(self, name: str | None, system: str | None, ui: Console) -> Iterator[OpenedChat]:
        from kvchat.chat.backend import LocalBackend
        from kvchat.chat.repl import next_session_name
        from kvchat.session_lock import sessions_lock
        from kvchat.sessions import SessionStore

        with sessions_lock(self.sessions_dir, "kvchat chat"):
            name = name or next_session_name(SessionStore(self.sessions_dir).names())
            runtime = open_runtime(self.build, ui)
            try:
                session = runtime.store.open(name)
                if system is not None:
                    session.system = system
                yield OpenedChat(LocalBackend(runtime), session, runtime.store.history_file())
            finally:
                close_runtime(runtime, ui)

    @contextlib.contextmanager
    def batch(self, items: list[BatchItem], spec: BatchSpec,
              ui: Console) -> Iterator[BatchRunner]:
        from kvchat.session_lock import sessions_lock

        with sessions_lock(self.sessions_dir, "kvchat batch"):
            runtime = open_runtime(self.build, ui)
            closed = False

            def save() -> None:
                nonlocal closed
                try:
                    runtime.save()
                except KvchatError as exc:
                    ui.print(f"[yellow]{escape(str(exc))}[/yellow]")
                finally:
                    closed = True
                    close_runtime(runtime, ui)

            try:
                yield self._runner(runtime, items, spec, ui, save)
            finally:
                if not closed:  # the run never started: nothing to save, the tier to close
                    close_runtime(runtime, ui)

    @staticmethod
    def _runner(runtime: Runtime, items: list[BatchItem], spec: BatchSpec, ui: Console,
                save: Callable[[], None]) -> BatchRunner:
        from kvchat.batch import BatchRun
        from kvchat.batch.run import choose_size, prepare_independent

        if runtime.notice:
            ui.print(f"[yellow]{escape(runtime.notice)}[/yellow]")
        if not runtime.engine.codec.has_template:
            from kvchat.models.chat_template import NO_TEMPLATE

            ui.print(f"[yellow]{escape(runtime.model_label)} {escape(NO_TEMPLATE)}[/yellow]",
                     soft_wrap=True)
        prepared = prepare_independent(runtime.engine.codec, items, spec.defaults)
        size = choose_size(runtime, spec.batch_size, items, spec.defaults.max_new_tokens,
                           prepared, ui.status)

        def start(update: Callable) -> BatchRun:  # type: ignore[type-arg]
            return BatchRun(runtime.engine, items, spec.defaults, runtime.store,
                            spec.fail_fast, update, pin_system=spec.pin_system,
                            prepared=prepared)

        return BatchRunner(start, runtime.cache.stats, save, size)
