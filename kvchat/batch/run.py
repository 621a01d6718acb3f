"""Running a request file through the engine: independent lines at once, session lines one
after another, each result reported as soon as it is in."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvchat.batch.recorder import NOT_STARTED, ItemResult, LineRun, SaveFailure, line_params
from kvchat.config import SamplingParams
from kvchat.errors import KvchatError
from kvchat.request_file import BatchItem
from kvchat.sessions import Session, SessionStore

if TYPE_CHECKING:  # the engine (and torch) load only when a run starts in this process
    from kvchat.engine.autobatch import Status
    from kvchat.engine.codec import ChatCodec
    from kvchat.engine.engine import Engine
    from kvchat.engine.sequence import Event
    from kvchat.runtime import Runtime
    from kvchat.turns import PreparedTurn


def line_turn(codec: ChatCodec, item: BatchItem, defaults: SamplingParams,
              session: Session | None = None) -> PreparedTurn:
    """A line's turn: its sampling parameters over the run's defaults, templated and
    tokenised (raises KvchatError or ValueError when the line cannot make one)."""
    from kvchat.turns import prepare_turn

    return prepare_turn(codec, item.messages, line_params(item, defaults), session, item.system)


def prepare_independent(codec: ChatCodec, items: list[BatchItem], defaults: SamplingParams
                        ) -> dict[int, PreparedTurn]:
    """The turns of the lines outside sessions, by line, tokenised once before the run: the
    batch size is chosen from their lengths and `BatchRun` submits them as they are (it holds
    all of them from its start anyway). A line that cannot make a turn is left out; the run
    reports its error."""
    turns = {}
    for item in items:
        if item.session is None:
            with contextlib.suppress(KvchatError, ValueError):
                turns[item.line] = line_turn(codec, item, defaults)
    return turns


class BatchRun(LineRun):
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
        prepared: dict[int, PreparedTurn] | None = None,
    ) -> None:
        super().__init__(items, fail_fast, on_update)
        self.engine = engine
        self.defaults = defaults
        self.sessions = sessions
        # line -> its turn, tokenised before the run; taken out as it is submitted, so a
        # finished line's prompt is not kept
        self._prepared = prepared if prepared is not None else {}
        self._waiting: dict[str, list[BatchItem]] = {}
        self._on_disk: dict[str, int] = {}  # session -> turns its file holds
        self.stopped = False
        self.pin_system = pin_system  # pin each distinct system prompt once it is cached
        self._to_pin: list[tuple[int, list[int]]] = []  # (line, system prefix tokens)
        self.pinned: dict[tuple[int, ...], int] = {}  # system prefix -> the line that pinned it
        self._tried: set[tuple[int, ...]] = set()

    def _submit(self, item: BatchItem) -> None:
        from kvchat.turns import refused

        turn = self._prepared.pop(item.line, None)
        if turn is None:
            try:
                session = self.sessions.open(item.session) if item.session else None
                if session is not None:
                    self._on_disk.setdefault(session.name, len(session.turns))
                turn = line_turn(self.engine.codec, item, self.defaults, session)
            except (KvchatError, ValueError) as exc:
                self._record(ItemResult(item, error=str(exc)))
                self._advance_session(item)
                return
        turn.keep_interrupted = False  # cut short, a line stays out of its session: --resume
        try:
            self.engine.submit(turn.request(), lambda event: self._event(item, turn, event))
        except KvchatError as exc:
            self._record(ItemResult(item, error=str(refused(turn, exc).error)))
            self._advance_session(item)

    def _event(self, item: BatchItem, turn: PreparedTurn, event: Event) -> None:
        from kvchat.engine.handle import RequestCancelled
        from kvchat.engine.sequence import Finished
        from kvchat.turns import finish

        if not isinstance(event, Finished):
            return
        pin = (lambda _: self._queue_pin(item, turn)) if self.pin_system else None
        outcome = finish(turn, event, self.sessions, pin)
        if outcome.result is None:
            not_started = isinstance(outcome.error, RequestCancelled)
            message = NOT_STARTED if not_started \
                else str(outcome.error or "the request did not run")
            self._record(ItemResult(item, error=message, not_started=not_started))
        else:
            if turn.session is not None and outcome.turn is not None:
                self._saved(turn.session, item.line, outcome.save_error)
            self._record(ItemResult(item, result=outcome.result))
        self._advance_session(item)

    def _queue_pin(self, item: BatchItem, turn: PreparedTurn) -> None:
        """Remember the line's system prefix, to pin between engine steps."""
        if turn.system is None:
            return
        try:
            tokens = turn.system_tokens(self.engine.codec)
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

    def _saved(self, session: Session, line: int | None, error: str | None) -> bool:
        """Note how a save of `session` went: a failure is reported (the reply is still
        written; only the transcript is not), a success brings its file up to date."""
        if error is not None:
            self.save_errors.append(SaveFailure(line, session.name, error))
            return False
        self._on_disk[session.name] = len(session.turns)
        return True

    def _save(self, session: Session, line: int | None) -> bool:
        try:
            self.sessions.save(session)
        except KvchatError as exc:
            return self._saved(session, line, str(exc))
        return self._saved(session, line, None)

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


def choose_size(runtime: Runtime, fixed: int | None, items: Sequence[BatchItem], max_tokens: int,
                prepared: Mapping[int, PreparedTurn], status: Status | None = None) -> str:
    """Set the engine's batch size for these lines: `fixed`, or --batch-size auto's choice
    (decode steps measured once per model, device and thread count, remembered in the kvchat
    cache dir, bounded so the longest row's K/V fits the pool). Returns how it was chosen, for
    the summary. `prepared`: the turns already tokenised, by line (a session line's prompt waits
    for its history: its messages alone stand for it here)."""
    import torch

    from kvchat.engine.autobatch import choose_batch_size
    from kvchat.models.gguf import cache_dir

    engine = runtime.engine
    if fixed is not None:
        engine.batch_size = fixed
        return str(fixed)

    def prompt_length(item: BatchItem) -> int:
        turn = prepared.get(item.line)
        return len(turn.prompt_ids if turn is not None else engine.codec.encode_chat(item.messages))

    longest = max((prompt_length(i) + (i.max_tokens or max_tokens) for i in items), default=1)
    pool = runtime.cache.stats().pool.capacity_tokens or 0
    facts = runtime.fingerprint
    key = f"{facts['model']}|{facts['config']}|{facts['dtype']}|{engine.device}|" \
          f"{torch.get_num_threads()}"
    # rows at once: every independent line, one per session (its lines run in turn)
    rows = sum(i.session is None for i in items) + len({i.session for i in items} - {None})
    work = sum(i.max_tokens or max_tokens for i in items)
    choice = choose_batch_size(engine.runner, key, cache_dir() / "batch-size.json", pool,
                               longest, status=status, rows=max(1, rows), work_steps=work)
    engine.batch_size = choice.size
    return choice.describe()
