"""The terminal side of `kvchat chat`: reading a line (prompt-toolkit, or plain input for a
pipe), and what a streaming reply does to the terminal (Ctrl-C stops it; typed-ahead keys are
not echoed into it)."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Protocol

from rich.cells import cell_len


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
    """For input that is not a terminal (a pipe, a file): one line per message. A line that is
    not UTF-8 raises InvalidText (`kvchat.text_input`) and is consumed: the next read goes on
    with the next line."""

    def read(self, prompt: str) -> str:
        from kvchat.text_input import decode_utf8

        stdin = getattr(sys.stdin, "buffer", None)
        if stdin is None:  # a text stream without bytes under it (a test's StringIO)
            return input(prompt)
        sys.stdout.write(prompt)
        sys.stdout.flush()
        raw = stdin.readline()
        if not raw:
            raise EOFError
        return decode_utf8(raw.removesuffix(b"\n").removesuffix(b"\r"), "This line")


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


class WordWrap:
    """Streams text to a terminal `width` cells wide, breaking lines between words (a word that
    would cross the edge starts the next line; one longer than a line breaks where it must).
    A word is held back until it is complete, so it is never split by the terminal."""

    def __init__(self, write: Callable[[str], object], width: int, column: int = 0) -> None:
        self.write = write
        self.width = max(width, 8)
        self.column = column
        self._word = ""

    def feed(self, text: str) -> None:
        for char in text:
            if char == "\n":
                self._flush_word()
                self.write("\n")
                self.column = 0
            elif char.isspace():
                self._flush_word()
                if self.column >= self.width:
                    self.write("\n")
                    self.column = 0
                else:
                    self.write(char)
                    self.column += cell_len(char)
            else:
                self._word += char
                if cell_len(self._word) >= self.width:
                    self._flush_word()

    def close(self) -> None:
        self._flush_word()

    def _flush_word(self) -> None:
        if not self._word:
            return
        size = cell_len(self._word)
        if self.column and self.column + size > self.width:
            self.write("\n")
            self.column = 0
        self.write(self._word)
        self.column += size
        self._word = ""
