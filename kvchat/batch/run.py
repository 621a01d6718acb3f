"""Running a request file through the engine: independent lines at once, session lines one
after another, each result reported as soon as it is in."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvchat.batch.requests import BatchItem
from kvchat.cache.stats import ratio
from kvchat.config import SamplingParams
from kvchat.errors import KvchatError
from kvchat.sessions import Session, SessionStore

if TYPE_CHECKING:  # the engine (and torch) load only when a run starts in this process
    from kvchat.engine.engine import Engine
    from kvchat.engine.sequence import Event, GenerationResult
    from kvchat.turns import PreparedTurn


@dataclass
class ItemResult:
    item: BatchItem
    result: GenerationResult | None = None
    error: str | None = None
    not_started: bool = False  # the run stopped before this line started


@dataclass(frozen=True)
class SaveFailure:
    """A session turn that ran (its row is written) but whose session file could not be
    saved: the session on disk is behind by that turn until a later save succeeds."""

    line: int | None  # None: the retry when the run ended
    session: str
    message: str


@dataclass
class BatchProgress:
    done: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def hit_rate(self) -> float:
        return ratio(self.hit_tokens, self.prompt_tokens)


class BatchRun:
    """Feeds items to the engine: independent items at once, session items one after another.
    A session line extends that session's history as a chat turn does, and the session is
    saved after it (so `kvchat chat --session NAME` or a later file continues it)."""

    def __init__(
        self,
        engine: Engine,
        items: list[BatchItem],
        defaults: SamplingParams,
        sessions: SessionStore,
        fail_fast: bool = False,
        on_update: Callable[[ItemResult], None] | None = None,
        pin_system: bool = False,
    ) -> None:
        self.engine = engine
        self.items = items
        self.defaults = defaults
        self.sessions = sessions
        self.fail_fast = fail_fast
        self.on_update = on_update
        self.results: dict[int, ItemResult] = {}
        self.progress = BatchProgress()
        self._waiting: dict[str, list[BatchItem]] = {}
        self.save_errors: list[SaveFailure] = []
        self._on_disk: dict[str, int] = {}  # session -> turns its file holds
        self.stopped = False
        self.pin_system = pin_system  # pin each distinct system prompt once it is cached
        self._to_pin: list[tuple[int, list[int]]] = []  # (line, system prefix tokens)
        self.pinned: dict[tuple[int, ...], int] = {}  # system prefix -> the line that pinned it
        self._tried: set[tuple[int, ...]] = set()
        self.pin_errors: list[str] = []

    def _submit(self, item: BatchItem) -> None:
        from kvchat.turns import merge_params, prepare_turn

        try:
            params = merge_params(self.defaults, item.max_tokens, item.temperature,
                                  seed=item.seed)
            session = self.sessions.open(item.session) if item.session else None
            if session is not None:
                self._on_disk.setdefault(session.name, len(session.turns))
            turn = prepare_turn(self.engine.codec, item.messages, params, session, item.system)
        except (KvchatError, ValueError) as exc:
            self._record(ItemResult(item, error=str(exc)))
            self._advance_session(item)
            return
        try:
            self.engine.submit(turn.request(), lambda event: self._event(item, turn, event))
        except KvchatError as exc:
            turn.abort()
            self._record(ItemResult(item, error=str(exc)))
            self._advance_session(item)

    def _event(self, item: BatchItem, turn: PreparedTurn, event: Event) -> None:
        from kvchat.engine.engine import RequestCancelled
        from kvchat.engine.sequence import Finished

        if not isinstance(event, Finished):
            return
        if event.result is None or event.error is not None:
            turn.abort()
            not_started = isinstance(event.error, RequestCancelled)
            message = "not run: the batch stopped before this line started" if not_started \
                else str(event.error or "the request did not run")
            self._record(ItemResult(item, error=message, not_started=not_started))
        else:
            self._commit(item, turn, event.result)
            self._record(ItemResult(item, result=event.result))
            if self.pin_system:
                self._queue_pin(item, turn)
        self._advance_session(item)

    def _queue_pin(self, item: BatchItem, turn: PreparedTurn) -> None:
        """Remember the line's system prefix, to pin between engine steps."""
        from kvchat.turns import system_prefix

        system = item.system or next((m["content"] for m in item.messages
                                      if m["role"] == "system"), None)
        if system is None and turn.session is not None:
            system = turn.session.system
        if system is None:
            return
        try:
            tokens = system_prefix(self.engine.codec, [{"role": "system", "content": system}],
                                   turn.prompt_ids)
        except KvchatError as exc:
            self.pin_errors.append(f"line {item.line}: {exc}")
            return
        if tuple(tokens) not in self._tried:  # each distinct system prompt once
            self._tried.add(tuple(tokens))
            self._to_pin.append((item.line, tokens))

    def _pin_queued(self) -> None:
        from kvchat.cache.pins import PinError

        cache = self.engine.cache
        while self._to_pin and cache is not None:
            line, tokens = self._to_pin.pop(0)
            try:
                cache.pin(tokens, label=f"system prompt of line {line}")
                self.pinned[tuple(tokens)] = line
            except PinError as exc:
                self.pin_errors.append(f"line {line}'s system prompt not pinned: {exc}")

    def _commit(self, item: BatchItem, turn: PreparedTurn, result: GenerationResult) -> None:
        if turn.commit(result) is None or turn.session is None:
            return
        self._save(turn.session, item.line)

    def _save(self, session: Session, line: int | None) -> bool:
        try:
            self.sessions.save(session)
        except KvchatError as exc:  # the reply is still written; only the transcript is not
            self.save_errors.append(SaveFailure(line, session.name, str(exc)))
            return False
        self._on_disk[session.name] = len(session.turns)
        return True

    def behind(self) -> dict[str, str]:
        """The sessions whose files lack turns that ran (a save failed and none succeeded
        since), each with how far behind it is."""
        out = {}
        for name, saved in sorted(self._on_disk.items()):
            turns = len(self.sessions.open(name).turns)
            if turns > saved:
                out[name] = f"{saved} of {turns} turns on disk"
        return out

    def save_behind(self) -> None:
        """Try once more to save each session that is behind (the disk may have room now);
        a failure is recorded again."""
        for name in self.behind():
            self._save(self.sessions.open(name), None)

    def _advance_session(self, item: BatchItem) -> None:
        if item.session is None or self.stopped:
            return
        queue = self._waiting.get(item.session)
        if queue:
            self._submit(queue.pop(0))

    def _record(self, res: ItemResult) -> None:
        self.results[res.item.line] = res
        p = self.progress
        p.done += 1
        if res.error is not None:
            p.failed += int(not res.not_started)
            if self.fail_fast:
                self.stop()
        elif res.result is not None:
            p.prompt_tokens += res.result.prompt_tokens
            p.hit_tokens += res.result.cache_hit_tokens
            p.completion_tokens += res.result.completion_tokens
        if self.on_update is not None:
            self.on_update(res)

    def stop(self) -> None:
        """Stop admitting, from anywhere (an event listener too): takes effect between steps;
        running requests then finish as interrupted and keep their K/V, waiting ones never
        start."""
        self.stopped = True

    def run(self) -> None:
        try:
            for item in self.items:
                if self.stopped:
                    break
                if item.session is None:
                    self._submit(item)
                elif item.session in self._waiting:
                    self._waiting[item.session].append(item)
                else:
                    self._waiting[item.session] = []
                    self._submit(item)
            while not self.stopped and not self.engine.idle:
                self.engine.step()
                self._pin_queued()
        except BaseException:
            self.stopped = True
            raise
        finally:
            if self.stopped:
                self.engine.abort()

    def ordered(self) -> list[ItemResult]:
        return [self.results[i.line] for i in self.items if i.line in self.results]

    def not_started(self) -> list[ItemResult]:
        """A result for every line that never ran (the run stopped first); not recorded."""
        message = "not run: the batch stopped before this line started"
        return [ItemResult(i, error=message, not_started=True) for i in self.items
                if i.line not in self.results]
