"""The chat loop of `kvchat chat`: read a line, run a turn or a slash command, print the panels.

The loop only decides what happens; views.py draws it. Each turn extends the session's own token
history (so the next turn's whole history is a cache hit), the session file is written after
every turn and the cache snapshot every few turns and on the way out, however the loop ends.
Ctrl-C while a reply streams stops that reply at the next step and keeps the REPL.
"""

from __future__ import annotations

import contextlib
import difflib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from rich.console import Console
from rich.text import Text

from kvchat.chat.backend import ChatBackend, LocalBackend, Reply, TurnDone, TurnFailed
from kvchat.chat.moves import MOVES, ConversationMoves
from kvchat.chat.terminal import LineReader, WordWrap, cancel_on_sigint, typeahead_hidden
from kvchat.errors import BackendGone, KvchatError
from kvchat.inspect.previews import preview
from kvchat.sessions import Session, SessionError, validate_name
from kvchat.text_input import InvalidText, check_text
from kvchat.ui import views

if TYPE_CHECKING:
    from kvchat.config import SamplingParams
    from kvchat.runtime import Runtime

# The snapshot holds every cached block's K/V, so it is written every few turns rather than
# after each one; the session file (small) is written after every turn.
SAVE_EVERY = 3
REPLY_PREFIX = "assistant> "

COMMANDS: dict[str, tuple[str, str]] = {
    "help": ("/help", "this list"),
    "stats": ("/stats", "cache counters, per-session hit rates, this session's turns"),
    "tree": ("/tree", "the radix tree, deeper than after a turn"),
    "sessions": ("/sessions", "saved sessions"),
    "session": ("/session NAME", "switch to session NAME (created if new)"),
    "new": ("/new", "start a fresh session with a generated name"),
    "reset": ("/reset", "forget this session's history (the shared cache keeps it)"),
    "clear-cache": ("/clear-cache", "drop every cached block, for all sessions"),
    "system": ("/system [TEXT | -]", "show, set, or with - clear this session's system prompt"),
    "save": ("/save", "write the session and the cache snapshot now"),
    "panels": ("/panels off|compact|full", "how much to show after each reply"),
    **MOVES,
    "exit": ("/exit", "save and quit"),
}
ALIASES = {"quit": "exit", "q": "exit", "?": "help", "h": "help"}
KEYS = (
    ("Enter", "send the message"),
    ("Esc, Enter", "new line: a message of several lines"),
    ("Ctrl-C", "stop the reply being written; at the prompt, clear the line"),
    ("Ctrl-D", "save and quit, like /exit"),
    ("//text", "send a message that starts with '/'"),
)
KEYS_LINE = "Enter send · Esc Enter newline · Ctrl-C stop reply · Ctrl-D quit · /help"


# ---- parsing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    name: str
    arg: str


def parse_command(line: str) -> Command | None:
    """A slash command, or None when the line is a message ('//' escapes a leading slash)."""
    text = line.strip()
    if not text.startswith("/") or text.startswith("//"):
        return None
    head, _, arg = text[1:].partition(" ")
    name = head.lower()
    return Command(ALIASES.get(name, name), arg.strip())


def message_text(line: str) -> str:
    text = line.strip()
    return text[1:] if text.startswith("//") else text


def unknown_command_hint(name: str) -> str:
    close = difflib.get_close_matches(name, list(COMMANDS) + list(ALIASES), n=1)
    guess = f" Did you mean /{close[0]}?" if close else ""
    shown = f"/{name}" if name else "/"
    return f"Unknown command {shown}.{guess} Type /help for the list."


# ---- the loop ------------------------------------------------------------------------------


def next_session_name(existing: list[str], prefix: str = "chat") -> str:
    taken = set(existing)
    n = 1
    while f"{prefix}-{n}" in taken:
        n += 1
    return f"{prefix}-{n}"


class Chat(ConversationMoves):
    """The REPL over a ChatBackend (a Runtime is wrapped in a LocalBackend)."""

    def __init__(
        self,
        backend: ChatBackend | Runtime,
        session: Session,
        params: SamplingParams,
        console: Console,
        reader: LineReader,
        panels: str = "full",
        save_every: int = SAVE_EVERY,
    ) -> None:
        self.backend: ChatBackend = (cast("ChatBackend", backend) if hasattr(backend, "start")
                                     else LocalBackend(cast("Runtime", backend)))
        self.store = self.backend.sessions
        self.session = session
        self.params = params
        self.console = console
        self.reader = reader
        self.panels = panels
        self.save_every = save_every
        self.running = True
        self._turns_since_snapshot = 0
        # (computed tokens, prefill ms) of turns that ran a prefill: the basis of "time saved"
        self._prefill_samples = [
            (t.prompt_tokens - t.hit_tokens, t.prefill_ms) for t in session.turns
        ]
        self._handlers: dict[str, Callable[[str], None]] = {
            "help": self._help,
            "stats": self._stats,
            "tree": self._tree,
            "sessions": self._sessions,
            "session": self._switch,
            "new": self._new,
            "reset": self._reset,
            "clear-cache": self._clear_cache,
            "system": self._system,
            "save": self._save,
            "panels": self._panels,
            "retry": self._retry,
            "rewind": self._rewind,
            "fork": self._fork,
            "branches": self._branches,
            "pin": self._pin,
            "unpin": self._unpin,
            "pins": self._pins,
            "exit": self._exit,
        }

    # ---- running ----

    def run(self) -> None:
        """Read and run lines until /exit or the end of input, then save. A backend that is
        gone (a server stopped or killed) ends the chat at once with one message: nothing can
        run or be saved through it any more."""
        self.console.print(views.banner(self.banner_lines()))
        try:
            self._loop()
            if self.save_all(snapshot=self.backend.owns_cache):  # a server saves its own
                self._say(self.backend.exit_note(self._session_note()), "dim")
        except BackendGone as gone:
            raise BackendGone(f"{gone} The chat ends here; once a server runs again, `kvchat "
                              f"chat --session {self.session.name}` goes on from the last turn "
                              "it recorded.") from None
        except BaseException:
            self.save_all(snapshot=self.backend.owns_cache)
            raise

    def _loop(self) -> None:
        while self.running:
            try:
                line = check_text(self.reader.read(f"{self.session.name}> "), "This line")
            except KeyboardInterrupt:
                continue  # Ctrl-C at the prompt clears the line
            except EOFError:
                self.console.print()
                break
            except InvalidText as error:  # the line is refused; the chat goes on
                self._say(f"{error} Nothing was sent.", "red")
                continue
            try:
                self.handle(line)
            except KeyboardInterrupt:
                self._say("(interrupted)", "yellow")

    def handle(self, line: str) -> None:
        if not line.strip():
            return
        command = parse_command(line)
        if command is None:
            self.turn(message_text(line))
            return
        handler = self._handlers.get(command.name)
        if handler is None:
            self._say(unknown_command_hint(command.name), "yellow")
            return
        why = self.backend.unavailable.get(command.name)
        if why is not None:
            self._say(f"/{command.name} is not available here: {why}", "yellow")
            return
        try:
            handler(command.arg)
        except BackendGone:
            raise
        except KvchatError as error:
            self._say(str(error), "red")

    def banner_lines(self) -> list[str]:
        lines = [*self.backend.banner_lines(), self._session_line()]
        if self.session.system:
            lines.append(f"system   {preview(self.session.system, 60)}")
        lines.append(KEYS_LINE)
        return lines

    def _session_line(self) -> str:
        s = self.session
        if s.turns:
            return f"session  {s.name}: resumed, {views.plural(len(s.turns), 'turn')}"
        return f"session  {s.name}: new"

    # ---- a turn ----

    def turn(self, text: str, params: SamplingParams | None = None) -> None:
        out = self.console.file
        try:
            reply = self.backend.start(self.session, text, params or self.params)
        except BackendGone:
            raise
        except KvchatError as error:
            self._say(str(error), "red")
            return
        # a local reply stops softly at the first Ctrl-C; a server's is hung up on
        soft = (cancel_on_sigint(reply.cancel_event) if reply.cancel_event is not None
                else contextlib.nullcontext())
        with soft, typeahead_hidden():
            out.write(REPLY_PREFIX)
            out.flush()
            self._stream(reply)
        done = reply.finish()
        if isinstance(done, TurnFailed):
            self._say(done.message, "red")
            return
        if done.turn.finish_reason == "interrupted":
            self.console.print(Text(" [stopped]", style="yellow"), end="")
        self.console.print()
        self._after_turn(done)

    def _after_turn(self, done: TurnDone) -> None:
        turn = done.turn
        self._saving(self._save_session)
        self._turns_since_snapshot += 1
        if self._turns_since_snapshot >= self.save_every and self.backend.owns_cache:
            self._saving(self.save_snapshot)
        result = done.result
        if result.hit_source != "exact":
            self._prefill_samples.append((result.computed_tokens, result.prefill_ms))
        rate = views.prefill_rate(self._prefill_samples)
        view = views.turn_view(len(self.session.turns), turn, result,
                               views.estimate_saved_ms(turn.hit_tokens, rate))
        if self.panels != "off":
            self.console.print(self.backend.turn_panels(view, self.panels, self.session.name))

    def _stream(self, reply: Reply) -> None:
        out = self.console.file
        # a terminal breaks lines mid-word at its edge; wrap between words instead
        wrap = WordWrap(out.write, self.console.width, len(REPLY_PREFIX)) \
            if self.console.is_terminal else None
        try:
            for delta in reply:
                text = views.printable(delta)
                if wrap is not None:
                    wrap.feed(text)
                else:
                    out.write(text)
                out.flush()
        except KeyboardInterrupt:
            reply.close()  # what was computed is kept
        finally:
            if wrap is not None:
                wrap.close()
                out.flush()

    # ---- helpers ----

    def _say(self, text: str, style: str | None = None) -> None:
        self.console.print(Text(text, style=style or ""))

    def _decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(ids)

    def save_snapshot(self) -> None:
        self.backend.save_snapshot()
        self._turns_since_snapshot = 0

    def _save_session(self) -> None:
        """Write the session's file, unless it is new and nothing happened in it: opening
        `kvchat chat` and quitting leaves no empty chat-N behind."""
        if self._worth_saving():
            self.store.save(self.session)

    def _worth_saving(self) -> bool:
        s = self.session
        return bool(s.turns or s.messages or s.tokens or s.system) or \
            s.name in self.store.names()

    def _session_note(self) -> str:
        """What became of the session on quitting, for the backend's exit note."""
        s = self.session
        if not self._worth_saving():
            return f"nothing for session {s.name} (no turns)"
        turns = len(s.turns)
        return f"session {s.name} ({turns} turn{'s' if turns != 1 else ''})"

    def save_all(self, snapshot: bool = True) -> bool:
        session = self._saving(self._save_session)
        return self._saving(self.save_snapshot) and session if snapshot else session

    def _saving(self, save: Callable[[], object]) -> bool:
        """A save that fails (a full disk, a read-only folder) is reported and the chat goes
        on; the session and the snapshot are written again after the next turn."""
        try:
            save()
            return True
        except BackendGone:
            raise  # nothing goes on through a backend that is gone
        except KvchatError as error:
            self._say(f"{error} The chat goes on; kvchat tries again after the next turn.",
                      "yellow")
            return False

    # ---- slash commands ----

    def _help(self, arg: str) -> None:
        self.console.print(views.help_view(list(COMMANDS.values()), KEYS))

    def _stats(self, arg: str) -> None:
        self.console.print(self.backend.stats_view(self.session.turns))

    def _tree(self, arg: str) -> None:
        self.console.print(self.backend.tree_view(self.session.name))

    def _sessions(self, arg: str) -> None:
        rows = []
        for name in self.store.names():
            if name == self.session.name:
                s = self.session
            else:
                try:
                    s = self.store.open(name, create=False)
                except SessionError:
                    continue  # load() moved the unreadable file aside
            rows.append(views.SessionRow(name, len(s.turns), s.updated, name == self.session.name))
        if self.session.name not in self.store.names():
            rows.append(views.SessionRow(self.session.name, 0, time.time(), True))
        self.console.print(views.sessions_table(rows))

    def _switch(self, arg: str) -> None:
        if not arg:
            self._say(f"This is session {self.session.name}. Usage: /session NAME")
            return
        name = validate_name(arg)
        if name == self.session.name:
            self._say(f"Already in session {name}.")
            return
        self._save_session()
        self._enter(self.store.open(name))

    def _new(self, arg: str) -> None:
        self._save_session()
        self._enter(Session(next_session_name([*self.store.names(), self.session.name])))

    def _enter(self, session: Session) -> None:
        self.session = session
        self._say(self._session_line().replace("session  ", "session ", 1))

    def _reset(self, arg: str) -> None:
        self.session.reset()
        self._save_session()
        self._say(f"Session {self.session.name} starts over; the shared cache is kept.")

    def _clear_cache(self, arg: str) -> None:
        freed = self.backend.clear_cache()
        self._say(f"Cleared the cache: {freed:,} blocks freed.")

    def _system(self, arg: str) -> None:
        if not arg:
            current = self.session.system
            self._say(f"System prompt: {current}" if current
                      else "No system prompt (the chat template's default applies).")
            return
        self.session.system = None if arg == "-" else arg
        self._save_session()
        self._say(
            "System prompt " + ("cleared" if arg == "-" else "set") + ". The next turn starts "
            "from a changed beginning, so only the unchanged part of the history is a hit."
        )

    def _save(self, arg: str) -> None:
        if not self.save_all():
            return
        self._say(f"Saved session {self.session.name} and {self.backend.saved()}.")

    def _panels(self, arg: str) -> None:
        mode = arg.lower()
        if mode not in views.PANEL_MODES:
            self._say(f"Panels are {self.panels}. Usage: /panels off|compact|full")
            return
        self.panels = mode
        self._say(f"Panels: {mode}.")

    def _exit(self, arg: str) -> None:
        self.running = False
