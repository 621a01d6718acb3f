"""What a caller holds of a submitted request: a `RequestHandle` (iterate it to drive the
engine from the calling thread, or give a listener and let another thread step), and the two
errors a request can end with before it produces anything."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

from kvchat.engine.sequence import (
    Event,
    GenerationResult,
    Request,
    Sequence,
    Status,
    TextDelta,
)
from kvchat.errors import KvchatError

Listener = Callable[[Event], None]


class PromptTooLongError(KvchatError):
    pass


class RequestCancelled(KvchatError):
    """The request was cancelled (or the run stopped) before it started."""


class Stepper(Protocol):
    """What a handle needs of the engine that runs it (the `Engine`)."""

    def step(self) -> None: ...

    def interrupt(self, seq: Sequence) -> None: ...


class RequestHandle:
    """A submitted request. Events (text deltas, then one Finished) go to the listener if one
    was given, else they queue here and iterating the handle yields the text while it drives
    the engine from this thread."""

    def __init__(self, engine: Stepper, seq_id: int, request: Request,
                 listener: Listener | None) -> None:
        self._engine = engine
        self._listener = listener
        self._events: deque[Event] = deque()
        self.seq = Sequence(seq_id, request, self._emit)

    @property
    def request_id(self) -> int:
        return self.seq.seq_id

    @property
    def done(self) -> bool:
        return self.seq.status is Status.FINISHED

    @property
    def result(self) -> GenerationResult | None:
        return self.seq.result

    @property
    def error(self) -> Exception | None:
        return self.seq.error

    def _emit(self, event: Event) -> None:
        if self._listener is not None:
            self._listener(event)
        else:
            self._events.append(event)

    def cancel(self) -> None:
        """Stop at the next step (from any thread); what was computed stays cached."""
        self.seq.cancel()

    def close(self) -> None:
        """Stop now, from the thread that steps the engine (e.g. after a second Ctrl-C)."""
        self._engine.interrupt(self.seq)

    def __iter__(self) -> Iterator[str]:
        while True:
            while self._events:
                event = self._events.popleft()
                if isinstance(event, TextDelta):
                    yield event.text
            if self.done:
                return
            self._engine.step()

    def run(self) -> GenerationResult:
        """Drive to the end; the result, or the error that kept the request from running."""
        for _ in self:
            pass
        if self.result is None:
            raise self.error or RequestCancelled("The request did not run.")
        return self.result
