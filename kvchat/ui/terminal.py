"""The terminal side of `kvchat chat`: reading a line (prompt-toolkit, or plain input for a
pipe), and what a streaming reply does to the terminal (Ctrl-C stops it; typed-ahead keys are
not echoed into it)."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Protocol


class LineReader(Protocol):
    def read(self, prompt: str) -> str:
        """One message; raises EOFError at the end of input, KeyboardInterrupt on Ctrl-C."""


class TerminalReader:
    """prompt-toolkit line editing with persistent history; Esc then Enter inserts a newline."""

    def __init__(self, history_file: Path) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory
        from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent

        bindings = KeyBindings()

        @bindings.add("escape", "enter")
        def _newline(event: KeyPressEvent) -> None:
            event.current_buffer.insert_text("\n")

        self._session: PromptSession[str] = PromptSession(
            history=FileHistory(str(history_file)),
            key_bindings=bindings,
            multiline=False,
            prompt_continuation=lambda width, line, soft: "." * (width - 1) + " ",
        )

    def read(self, prompt: str) -> str:
        return self._session.prompt(prompt)


class PipeReader:
    """For input that is not a terminal (a pipe, a file): one line per message."""

    def read(self, prompt: str) -> str:
        return input(prompt)


def make_reader(history_file: Path) -> LineReader:
    if sys.stdin.isatty() and sys.stdout.isatty():
        return TerminalReader(history_file)
    return PipeReader()


@contextmanager
def cancel_on_sigint(cancel: threading.Event) -> Iterator[None]:
    """While a reply streams: the first Ctrl-C sets `cancel` (the generation stops at its next
    step), a second one raises KeyboardInterrupt as usual. The previous handler comes back after."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()

    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def typeahead_hidden() -> Iterator[None]:
    """While a reply streams, keys typed ahead are not echoed into it: they stay queued, and the
    next prompt shows them. Ctrl-C still raises SIGINT (only ECHO is turned off)."""
    import termios

    try:
        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd)
    except (termios.error, OSError, ValueError):
        yield  # not a terminal (a pipe, a test runner's stream)
        return
    quiet = termios.tcgetattr(fd)
    quiet[3] &= ~termios.ECHO  # lflag
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)
