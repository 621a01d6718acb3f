"""Conversation moves in `kvchat chat`: /retry, /rewind, /fork, /branches, and /pin, /unpin,
/pins to keep a prefix in the pool.

The radix tree already holds every earlier state of a conversation, so these are nearly free:
a retried prompt is an exact hit, a rewound conversation continues from a cached prefix, and a
fork shares its history's blocks instead of copying them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvchat.errors import KvchatError
from kvchat.inspect.previews import preview
from kvchat.sessions import Session, SessionError, validate_name

if TYPE_CHECKING:
    from kvchat.chat.backend import ChatBackend, Sessions
    from kvchat.config import SamplingParams
    from kvchat.sessions import Branch, MessageBranch

MOVES: dict[str, tuple[str, str]] = {
    "retry": ("/retry", "regenerate the last reply (its prompt is an exact hit: no prefill)"),
    "rewind": ("/rewind [N]", "drop the last N turns (default 1); what is left stays cached"),
    "fork": ("/fork NAME", "a new session with this one's history (shared blocks, no copies)"),
    "branches": ("/branches", "sessions that share this one's history, and where they part"),
    "pin": ("/pin [all]", "keep this session's system prompt (or all its history) in the pool: "
            "eviction never takes it"),
    "unpin": ("/unpin", "end the pins on this session's history"),
    "pins": ("/pins", "what is pinned, and how much of --max-pinned it uses"),
}


class ConversationMoves:
    """Slash commands that move within a session's history; mixed into the REPL's Chat."""

    session: Session
    store: Sessions
    backend: ChatBackend
    params: SamplingParams
    _say: Callable[..., None]
    _decode: Callable[[Sequence[int]], str]
    _enter: Callable[[Session], None]
    _save_session: Callable[[], None]
    console: Console

    def turn(self, text: str, params: SamplingParams | None = None) -> None:
        raise NotImplementedError

    def _retry(self, arg: str) -> None:
        s = self.session
        if not s.turns:
            self._say("Nothing to retry yet: send a message first.")
            return
        text, reply = s.messages[-2]["content"], s.messages[-1]["content"]
        last = s.turns[-1]
        before: list[Any] = s.tokens[last.prompt_tokens:]  # the reply being retried
        saved = s.fork(s.name)
        s.rewind(1)
        params = self.params
        if not params.greedy:  # a new seed, or sampling would give the same reply again
            params = replace(params, seed=random.getrandbits(63))
        self.turn(text, params)
        if len(s.turns) != len(saved.turns):  # the retry did not run: keep the old turn
            s.messages[:], s.tokens[:], s.turns[:] = saved.messages, saved.tokens, saved.turns
            return
        now = s.turns[-1]
        again: list[Any] = s.tokens[now.prompt_tokens:]
        if last.reported_by or now.reported_by:  # an engine's tokens are its own: compare text
            before, again = list(reply), list(s.messages[-1]["content"])
        hit = "an exact hit, no prefill" if now.source == "exact" else \
            f"{now.hit_tokens:,} of {now.prompt_tokens:,} tokens cached" + (
                f" ({now.reported_by} reported)" if now.source == "reported" else "") \
            if now.source != "unreported" else f"not reported as cached by {now.reported_by}"
        how = "at temperature 0" if self.params.greedy else "with a new seed"
        same = compare_replies(before, last.finish_reason, again, now.finish_reason)
        self._say(f"Retried: the prompt was {hit}; {how} the reply is {same}.", "dim")

    def _rewind(self, arg: str) -> None:
        try:
            n = int(arg) if arg else 1
        except ValueError:
            n = 0
        if n < 1:
            raise KvchatError(f"Usage: /rewind [N] with N a positive number, got {arg!r}.")
        if not self.session.turns:
            self._say("Nothing to rewind: this session has no turns yet.")
            return
        gone = self.session.rewind(n)
        self.store.save(self.session)
        left = len(self.session.turns)
        cached = ("and everything before it is still cached" if self.backend.history == "tokens"
                  else "resending what is left, which the engine has cached while it holds it")
        self._say(f"Rewound {gone} turn(s); {left} left. The next message continues from there, "
                  f"{cached}.")

    def _fork(self, arg: str) -> None:
        if not arg:
            raise KvchatError("Usage: /fork NAME (a new session that starts with this history).")
        name = validate_name(arg)
        if self.store.exists(name):
            raise SessionError(f"A session {name!r} exists already; fork under another name.")
        self._save_session()
        fork = self.session.fork(name)
        self.store.save(fork)
        if self.backend.history == "tokens":
            self._say(f"Forked {self.session.name} into {name}: {len(fork.tokens):,} tokens "
                      "of history, read from the same cached blocks (nothing copied).")
        else:
            self._say(f"Forked {self.session.name} into {name}: {len(fork.messages):,} "
                      "messages of history, resent as the same prefix by its next turn.")
        self._enter(self.store.open(name))

    def _branches(self, arg: str) -> None:
        from kvchat.sessions import branches

        others = []
        for name in self.store.names():
            if name == self.session.name:
                continue
            try:
                others.append(self.store.open(name, create=False))
            except SessionError:
                continue
        if self.backend.history == "messages":
            from kvchat.sessions import message_branches

            by_message = message_branches(self.session, others)
            if by_message:
                self.console.print(message_branches_table(self.session, by_message))
                return
        else:
            rows = branches(self.session, others)
            if rows:
                self.console.print(branches_table(self.session, rows, self._decode))
                return
        self._say("No other session shares this one's history.")


    def _pin(self, arg: str) -> None:
        what = arg.strip().lower() or "system"
        if what not in ("system", "all"):
            raise KvchatError(f"Usage: /pin [all], got {arg!r}.")
        pin = self.backend.pin(self.session, what)
        self._say(f"Pinned {pin.label}: {pin.tokens:,} tokens in {pin.blocks:,} blocks stay in "
                  "the pool whatever eviction needs (/unpin ends it).", "dim")

    def _unpin(self, arg: str) -> None:
        gone = self.backend.unpin(self.session)
        if not gone:
            self._say("Nothing pinned on this session's history.")
            return
        names = ", ".join(f"{p.label} ({p.tokens:,} tokens)" for p in gone)
        self._say(f"Unpinned {names}; eviction may take those blocks again.", "dim")

    def _pins(self, arg: str) -> None:
        info = self.backend.pins()
        cap = f" of {info.cap_blocks:,} allowed" if info.cap_blocks else ""
        if not info.pins:
            self._say("Nothing pinned." + (f" Pins may hold up to {info.cap_blocks:,} pool "
                                           "blocks." if cap else ""))
            return
        t = Table(title=f"pins · {info.pinned_blocks:,} blocks{cap}", title_justify="left")
        t.add_column("pin")
        t.add_column("tokens", justify="right")
        t.add_column("blocks", justify="right")
        for p in info.pins:
            t.add_row(p.label, f"{p.tokens:,}", f"{p.blocks:,}")
        self.console.print(t)


def compare_replies(before: Sequence[object], before_end: str, again: Sequence[object],
                    again_end: str) -> str:
    """How a retried reply compares with the one it replaced; a reply stopped early is the
    other's beginning, not a different reply."""
    if list(again) == list(before):
        return "identical"
    if before_end == "interrupted" and list(again[: len(before)]) == list(before):
        return "the same as the stopped one, this time not stopped"
    if again_end == "interrupted" and list(before[: len(again)]) == list(again):
        return "the same as before, up to where this one was stopped"
    return "different"


def branches_table(session: Session, rows: Sequence[Branch],
                   decode: Callable[[Sequence[int]], str]) -> Table:
    """Sessions sharing `session`'s history: how much, and the text on each side of where they
    part."""
    t = Table(title=f"sessions sharing {session.name}'s history", title_justify="left")
    t.add_column("session")
    t.add_column("shared tokens", justify="right")
    t.add_column("then this one")
    t.add_column("then that one")
    for b in rows:
        here = decode(session.tokens[b.shared: b.shared + 8])
        there = decode(b.tokens[b.shared: b.shared + 8])
        t.add_row(b.name, f"{b.shared:,}", Text(preview(here, 24) or "(ends here)"),
                  Text(preview(there, 24) or "(ends here)"))
    return t


def message_branches_table(session: Session, rows: Sequence[MessageBranch]) -> Table:
    """Sessions whose conversation starts like `session`'s: how many messages, then what
    each says next."""
    t = Table(title=f"sessions sharing {session.name}'s conversation", title_justify="left")
    t.add_column("session")
    t.add_column("shared messages", justify="right")
    t.add_column("then this one")
    t.add_column("then that one")
    for b in rows:
        t.add_row(b.name, f"{b.shared:,}", Text(preview(b.here, 24) or "(ends here)"),
                  Text(preview(b.there, 24) or "(ends here)"))
    return t
