"""Sessions on disk: transcripts (the lock: kvchat/session_lock.py; the cache's files:
kvchat/snapshots.py).

Layout of a sessions dir (default ./sessions), private to its owner (folders 0700, files 0600,
whatever the umask: transcripts and the cache tree hold prompt text):
    <name>.json                 one session: messages, token history, per-turn stats
    tenants/<id>/<name>.json    a server tenant's sessions
    cache/index.json            the cache's index (tree with tokens and block keys, exact entries,
                                stats, fingerprint); readable without torch (`kvchat inspect`)
    cache/store/, cache/exact/  the disk tier's block files and the exact entries' logits
    cache/set-aside/            indexes and files that did not match or parse (never deleted)
    .history                    the REPL's input history
    .lock                       held by the process using this dir, as one JSON object: its
                                pid, and a server's address and access token (0600)

Every write is atomic (temp file, fsync, rename): an interrupted save leaves the previous state,
a failed one (read-only folder, full disk) raises SessionWriteError saying what to do.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from kvchat.cache.radix import common_prefix
from kvchat.cache.stats import ratio
from kvchat.errors import KvchatError
from kvchat.files import (
    WriteError,
    atomic_write,
    open_private,
    private_dir,
    write_error,
)
from kvchat.text_input import json_problem

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # always fullmatch: `$` lets "a\n" in
RESERVED = {"cache", "set-aside"}


class SessionError(KvchatError):
    pass


class SessionNotFound(SessionError):
    """A session asked for by name, without permission to create it, has no file."""


# A file in the sessions dir could not be written (read-only folder, full disk, ...).
SessionWriteError = WriteError


def validate_name(name: str) -> str:
    if not NAME_RE.fullmatch(name) or name in RESERVED or name.endswith(".json"):
        raise SessionError(
            f"Invalid session name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting "
            "with a letter or digit (no path separators)."
        )
    return name


# ---- sessions ------------------------------------------------------------------------------


@dataclass
class Turn:
    prompt_tokens: int
    hit_tokens: int
    source: str
    completion_tokens: int
    ttft_ms: float
    prefill_ms: float
    finish_reason: str
    start_tokens: int = -1  # history tokens before this turn (-1: unknown, an older file)
    # the engine whose reply reported these counts ("": kvchat's own cache); such a turn
    # leaves the token history as it was (the engine's tokens are its own)
    reported_by: str = ""

    @property
    def hit_rate(self) -> float:
        return ratio(self.hit_tokens, self.prompt_tokens)


@dataclass
class Session:
    """A conversation: its messages and the exact token history the model has seen, which the
    next turn extends (re-tokenising the transcript could split differently and miss the cache)."""

    name: str
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    def reset(self) -> None:
        self.messages.clear()
        self.tokens.clear()
        self.turns.clear()

    def rewind(self, n: int = 1) -> int:
        """Drop the last n turns (messages, turns and their tokens); returns how many went. The
        history left is a prefix of what the model saw, so the next turn hits all of it."""
        n = min(n, len(self.turns))
        if n <= 0:
            return 0
        first = self.turns[-n]
        del self.turns[-n:]
        del self.messages[-2 * n:]
        if 0 <= first.start_tokens <= len(self.tokens):
            del self.tokens[first.start_tokens:]
        else:  # an older file without the boundary: the next turn re-templates the transcript
            self.tokens.clear()
        return n

    def fork(self, name: str) -> Session:
        """A new session with this one's history; in the cache the history is one prefix, so
        both sessions read the same blocks."""
        return Session(validate_name(name), self.system, [dict(m) for m in self.messages],
                       list(self.tokens), [replace(t) for t in self.turns])

    def to_json(self) -> dict[str, Any]:
        return {**vars(self), "turns": [asdict(t) for t in self.turns]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Session:
        """A session from its document; ValueError when the document's text is not valid
        Unicode (`kvchat.text_input`: refused, never replaced), KeyError or TypeError when it
        is not a session's."""
        problem = json_problem(data)
        if problem is not None:
            raise ValueError(f"text that is not valid Unicode ({problem})")
        system, messages = data.get("system"), data.get("messages", [])
        if system is not None and not isinstance(system, str):
            raise TypeError('"system" must be a string')
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and m.get("role") in _ROLES
                and isinstance(m.get("content"), str) for m in messages):
            raise TypeError('"messages" must be a list of {"role": "user" or "assistant" (or '
                            '"system"), "content": a string} objects')
        turns = [_turn(t) for t in data.get("turns", [])]
        if len(messages) < 2 * len(turns):
            raise ValueError("each turn needs its user and assistant message")
        return cls(name=str(data["name"]), system=system,
                   messages=[{"role": m["role"], "content": m["content"]} for m in messages],
                   tokens=[_count(t, "tokens") for t in data.get("tokens", [])], turns=turns,
                   created=float(data.get("created", time.time())),
                   updated=float(data.get("updated", time.time())))


_ROLES = ("system", "user", "assistant")


def _count(value: Any, what: str) -> int:
    """A whole number >= 0 of a session document (a token id, a turn's count); TypeError
    otherwise, never a bool or a float."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f'"{what}" must hold whole numbers >= 0, got {value!r}')
    return value


def _turn(doc: Any) -> Turn:
    """One turn's record, with the types the REPL does arithmetic on."""
    if not isinstance(doc, dict):
        raise TypeError("each turn must be an object")
    turn = Turn(**doc)
    for name in ("prompt_tokens", "hit_tokens", "completion_tokens"):
        _count(getattr(turn, name), f"turns.{name}")
    if isinstance(turn.start_tokens, bool) or not isinstance(turn.start_tokens, int):
        raise TypeError('"turns.start_tokens" must be a whole number')
    for name in ("ttft_ms", "prefill_ms"):
        if isinstance(getattr(turn, name), bool) or not isinstance(getattr(turn, name),
                                                                   int | float):
            raise TypeError(f'"turns.{name}" must be a number')
    if not isinstance(turn.source, str) or not isinstance(turn.finish_reason, str):
        raise TypeError('"turns.source" and "turns.finish_reason" must be strings')
    return turn


@dataclass(frozen=True)
class Branch:
    """Another session that shares a session's history: for how many tokens, then its own."""

    name: str
    shared: int
    tokens: list[int]
    turns: int


def branches(session: Session, others: Sequence[Session]) -> list[Branch]:
    """The sessions whose token history starts like `session`'s, most shared first."""
    out = []
    for other in others:
        if other.name == session.name:
            continue
        shared = common_prefix(session.tokens, other.tokens)
        if shared:
            out.append(Branch(other.name, shared, list(other.tokens), len(other.turns)))
    return sorted(out, key=lambda b: (-b.shared, b.name))


class MessageBranch(NamedTuple):
    """Another session whose conversation starts like a session's: for how many messages (the
    system prompt counts as one), then what each says next ("" where it ends)."""

    name: str
    shared: int
    here: str
    there: str


def message_branches(session: Session, others: Sequence[Session]) -> list[MessageBranch]:
    """`branches` by messages, for sessions on an engine whose token ids are its own."""
    def said(s: Session) -> list[tuple[str, str]]:
        head = [("system", s.system)] if s.system else []
        return head + [(m["role"], m["content"]) for m in s.messages]

    mine, out = said(session), []
    for other in others:
        theirs = said(other)
        shared = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False))
                       if a != b),
                      min(len(mine), len(theirs)))
        if other.name != session.name and shared:
            out.append(MessageBranch(other.name, shared,
                                     mine[shared][1] if shared < len(mine) else "",
                                     theirs[shared][1] if shared < len(theirs) else ""))
    return sorted(out, key=lambda b: (-b.shared, b.name))


class SessionStore:
    """Session files in one sessions dir, and the registry of the sessions open in this process:
    `open` hands every caller (chat, batch, serve) the same Session object for a name, so turns
    recorded through one are never lost by another's save."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._open: dict[str, Session] = {}
        self._lock = threading.Lock()  # the server opens sessions from worker threads

    def path(self, name: str) -> Path:
        return self.root / f"{validate_name(name)}.json"

    def exists(self, name: str) -> bool:
        """The session has a file, or is open in this process (created, not yet saved)."""
        return name in self._open or self.path(name).exists()

    def open(self, name: str, create: bool = True) -> Session:
        """The session named `name`, the same object on every call: loaded from its file the
        first time, or created (not saved: `save` does that). Raises SessionNotFound when it
        does not exist and `create` is False, SessionError when its file is unreadable."""
        with self._lock:
            session = self._open.get(name)
            if session is None:
                if self.path(name).exists():
                    session = self.load(name)
                elif create:
                    session = Session(name)
                else:
                    saved = ", ".join(self.names()[:10]) or "none yet"
                    raise SessionNotFound(f"No session {name!r} in {self.root} (saved sessions: "
                                          f"{saved}). Ask for it to be created to start it.")
                self._open[name] = session
            return session

    def load(self, name: str) -> Session:
        """The session as its file holds it now (a new object each call; a new Session if there
        is no file). Front ends use `open`, which keeps one object per name."""
        path = self.path(name)
        try:
            return Session.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            return Session(name)
        except (ValueError, KeyError, TypeError) as exc:
            aside = set_aside(path, self.root / "cache" / "set-aside")
            raise SessionError(
                f"Session file {path} could not be read ({exc}); it was moved to {aside}."
            ) from exc

    def save(self, session: Session) -> None:
        """Write the session's file; the session saved is the one `open` returns for its name."""
        path = self.path(session.name)
        session.updated = time.time()
        atomic_write(path, json.dumps(session.to_json()).encode(), f"session {session.name!r}")
        with self._lock:
            self._open[session.name] = session  # the object last saved is what the file holds

    def names(self) -> list[str]:
        """Names of the saved sessions, sorted."""
        if not self.root.is_dir():
            return []
        return sorted(p.stem for p in self.root.glob("*.json")
                      if NAME_RE.fullmatch(p.stem) and p.stem not in RESERVED)

    def history_file(self) -> Path:
        """The REPL's input history, created 0600 here (prompt-toolkit would follow the umask)."""
        path = private_dir(self.root) / ".history"
        try:
            os.close(open_private(path, os.O_WRONLY | os.O_APPEND))
        except OSError as exc:
            raise write_error("the input history", path, exc, atomic=False) from exc
        return path


def set_aside(path: Path, folder: Path) -> Path:
    """Move a file that cannot be used out of the way, keeping it for the user to inspect."""
    private_dir(folder.parent, "the cache folder")
    private_dir(folder, "the set-aside folder")
    target = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}-{path.name}"
    return move_file(path, target)


def move_file(path: Path, target: Path) -> Path:
    try:
        os.replace(path, target)
    except OSError as exc:
        raise write_error(f"{path.name} into {target.parent}", path, exc, atomic=False) from exc
    return target


def cache_dir(root: Path) -> Path:
    return Path(root) / "cache"
