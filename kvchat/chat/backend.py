"""What the chat loop talks to: a `ChatBackend`, either the runtime in this process
(`LocalBackend`) or a resident server over HTTP (`kvchat.chat.server.ServerBackend`).

The REPL never touches an engine or a cache itself: it starts a turn and streams its `Reply`,
reads stats and the tree for its panels, and keeps sessions through the backend's `sessions`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

from kvchat.errors import KvchatError

# the banner's line for a model without a chat template (`kvchat.models.chat_template`)
PLAIN_LINE = ("template none: plain text, 'User:' / 'Assistant:' paragraphs "
              "(--chat-template sets one)")

if TYPE_CHECKING:
    from rich.console import RenderableType

    from kvchat.cache.stats import CacheStats
    from kvchat.config import SamplingParams
    from kvchat.engine.handle import RequestHandle
    from kvchat.engine.result import GenerationResult
    from kvchat.inspect.documents import NodeView
    from kvchat.runtime import Runtime
    from kvchat.sessions import Session, SessionStore, Turn
    from kvchat.turns import PreparedTurn
    from kvchat.ui.views import TurnView


class TurnDone(NamedTuple):
    """A reply that ran (finished, or stopped and kept): the turn as the session recorded it,
    and the result the panels show (`views.turn_view`): the engine's own in this process, read
    back from a server's reply (`kvchat.chat.server`), or from the turn's record for an
    engine that reports less (`responses.result_from_turn`)."""

    turn: Turn
    result: GenerationResult


class PinInfo(NamedTuple):
    """A pinned prefix as the chat shows it."""

    pin_id: str
    label: str
    tokens: int
    blocks: int


class PinsInfo(NamedTuple):
    pins: list[PinInfo]
    pinned_blocks: int
    cap_blocks: int  # --max-pinned of the pool


class TurnFailed(NamedTuple):
    message: str


class Reply(Protocol):
    """A reply being generated: iterate for its text deltas; `finish()` then records it."""

    # set by the first Ctrl-C to stop at the next step (None: Ctrl-C raises, and the loop
    # calls close())
    cancel_event: threading.Event | None

    def __iter__(self) -> Iterator[str]: ...

    def close(self) -> None:
        """Stop now, keeping what was computed (a second Ctrl-C, or a server stream hung up)."""

    def finish(self) -> TurnDone | TurnFailed:
        """The outcome, once the deltas have ended; a TurnDone is in the session's turns."""


class Sessions(Protocol):
    """Session files: in the sessions dir, or on the server."""

    def names(self) -> list[str]: ...

    def exists(self, name: str) -> bool: ...

    def open(self, name: str, create: bool = True) -> Session: ...

    def save(self, session: Session) -> None: ...


class ChatBackend(Protocol):
    sessions: Sessions
    owns_cache: bool  # the snapshot is this process's to save (not a server's)
    history: str  # how sessions are compared (/branches): "tokens", or "messages" for an
    # engine whose tokens are its own
    unavailable: dict[str, str]  # slash command -> why it is not available here

    def banner_lines(self) -> list[str]: ...

    def start(self, session: Session, text: str, params: SamplingParams) -> Reply:
        """Start the session's next turn; raises KvchatError when it cannot start."""

    def decode(self, ids: Sequence[int]) -> str: ...

    def save_snapshot(self) -> None: ...

    def clear_cache(self) -> int: ...

    def pin(self, session: Session, what: str) -> PinInfo:
        """Pin the session's system prompt ("system") or all of it that is cached ("all");
        raises KvchatError when it cannot (not cached yet, over --max-pinned)."""

    def unpin(self, session: Session) -> list[PinInfo]:
        """End the pins that cover a prefix of the session's history."""

    def pins(self) -> PinsInfo: ...

    # what the panels and /stats, /tree, /save show of the cache (`CacheViews` for kvchat's
    # own cache; an engine that only reports numbers shows those)

    def turn_panels(self, view: TurnView, mode: str, highlight: str) -> RenderableType: ...

    def stats_view(self, turns: Sequence[Turn]) -> RenderableType: ...

    def tree_view(self, highlight: str) -> RenderableType: ...

    def saved(self) -> str:
        """What /save wrote besides the session, for its message."""

    def exit_note(self, session: str) -> str:
        """What quitting left saved, and where: `session` says what became of the session
        ("session trip (2 turns)")."""


class CacheViews:
    """The views of a kvchat cache, in this process or on a kvchat server: pool, radix tree,
    counters."""

    history = "tokens"

    def stats(self) -> CacheStats:
        raise NotImplementedError

    def nodes(self) -> Sequence[NodeView]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def integrity(self) -> str:
        raise NotImplementedError

    def turn_panels(self, view: TurnView, mode: str, highlight: str) -> RenderableType:
        from kvchat.ui import views

        return views.turn_panels(view, self.stats(), self.nodes(), self.decode, mode,
                                 highlight)

    def stats_view(self, turns: Sequence[Turn]) -> RenderableType:
        from kvchat.ui import views

        return views.stats_view(self.stats(), turns, self.integrity())

    def tree_view(self, highlight: str) -> RenderableType:
        from kvchat.ui import views

        return views.tree_view(self.nodes(), self.decode, depth=8, max_children=8,
                               highlight=highlight)

    def saved(self) -> str:
        return f"the cache snapshot ({self.stats().tree_tokens:,} tokens)"


# ---- in this process -----------------------------------------------------------------------


class LocalReply:
    def __init__(self, handle: RequestHandle, turn: PreparedTurn) -> None:
        self.handle = handle
        self.turn = turn
        self.cancel_event: threading.Event | None = handle.seq.cancel_event

    def __iter__(self) -> Iterator[str]:
        return iter(self.handle)

    def close(self) -> None:
        # the engine may be between steps; finishing now stores what it computed
        self.handle.close()

    def finish(self) -> TurnDone | TurnFailed:
        from kvchat.engine.sequence import Finished
        from kvchat.turns import finish

        # a failure aborts the turn: what it computed is cached; the session is as it was.
        # The REPL saves the session after the turn (and says so when it cannot).
        done = finish(self.turn, Finished(self.handle.result, self.handle.error))
        result, turn = done.result, done.turn
        if result is None:
            return TurnFailed(str(done.error or "The reply could not be generated."))
        assert turn is not None
        return TurnDone(turn, result)


class LocalBackend(CacheViews):
    """The runtime (engine, cache, sessions dir) in this process."""

    owns_cache = True

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.sessions: Sessions = runtime.store
        self.unavailable: dict[str, str] = {}

    @property
    def store(self) -> SessionStore:
        return self.rt.store

    def exit_note(self, session: str) -> str:
        where = self.rt.options.sessions_dir
        return f"Saved {session} and {self.saved()} in {where}."

    def banner_lines(self) -> list[str]:
        rt = self.rt
        pool = rt.cache.manager.stats()
        lines = [
            f"model    {rt.model_label}",
            *([] if rt.engine.codec.has_template else [PLAIN_LINE]),
            f"device   {rt.engine.device} · {rt.engine.runner.precision_label}",
            f"forward  {rt.engine.runner.plan.describe()}",
            f"cache    {pool.total_blocks:,} blocks × {pool.block_size} tok · "
            f"policy {rt.cache.policy.name}",
            f"sessions {rt.options.sessions_dir}",
        ]
        if rt.notice:
            lines.append(f"snapshot {rt.notice}")
        elif rt.restored_tokens:
            lines.append(f"snapshot restored {rt.restored_tokens:,} cached tokens")
        else:
            lines.append("snapshot none yet (written every few turns and on exit)")
        return lines

    def start(self, session: Session, text: str, params: SamplingParams) -> Reply:
        from kvchat.engine.handle import PromptTooLongError
        from kvchat.turns import prepare_turn, refused

        engine = self.rt.engine
        turn = prepare_turn(engine.codec, [{"role": "user", "content": text}], params, session)
        try:
            handle = engine.submit(turn.request())
        except PromptTooLongError as error:
            refused(turn, error)
            raise KvchatError(f"{error} Start over with /reset or /new.") from None
        except KvchatError as error:
            refused(turn, error)
            raise
        return LocalReply(handle, turn)

    def stats(self) -> CacheStats:
        return self.rt.cache.stats()

    def nodes(self) -> Sequence[NodeView]:
        from kvchat.inspect.documents import nodes_from_cache

        return nodes_from_cache(self.rt.cache)

    def decode(self, ids: Sequence[int]) -> str:
        return self.rt.engine.codec.decode(list(ids), skip_special_tokens=False)

    def integrity(self) -> str:
        try:
            self.rt.cache.check_integrity()
            return "ok"
        except AssertionError as error:
            return f"FAILED ({error})"

    def save_snapshot(self) -> None:
        self.rt.save()

    def clear_cache(self) -> int:
        return int(self.rt.cache.clear())

    def pin(self, session: Session, what: str) -> PinInfo:
        from kvchat.cache.pins import PinError
        from kvchat.turns import system_tokens

        cache = self.rt.cache
        if not session.tokens:
            raise KvchatError("Nothing to pin yet: send a message first.")
        if what == "all":
            tokens, label = session.tokens[: cache.peek(session.tokens)], f"{session.name} (all)"
        else:
            tokens = system_tokens(self.rt.engine.codec, session.system, session.tokens)
            label = "system prompt"
        try:
            pin = cache.pin(tokens, label=label)
        except PinError as error:
            raise KvchatError(f"Not pinned: {error}") from None
        return PinInfo(pin.pin_id, pin.label, len(pin.tokens), len(pin.block_ids))

    def unpin(self, session: Session) -> list[PinInfo]:
        cache = self.rt.cache
        gone = [p for p in cache.pins if not p.namespace
                and list(p.tokens) == session.tokens[: len(p.tokens)]]
        for pin in gone:
            cache.unpin(pin.pin_id)
        return [PinInfo(p.pin_id, p.label, len(p.tokens), len(p.block_ids)) for p in gone]

    def pins(self) -> PinsInfo:
        table = self.rt.cache.pins
        rows = [PinInfo(p.pin_id, p.label, len(p.tokens), len(p.block_ids)) for p in table]
        return PinsInfo(rows, len(table.block_ids), table.cap)
