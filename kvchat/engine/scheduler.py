"""Request queue and admission.

`admit_pending()` is where the design document's lookup flow starts: each admitted request calls
`backend.prefill_lookup` (inside `Backend.start`) and holds its cached blocks until it finishes.
Requests run one after another here; the queue/handle interface does not assume that.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvchat.engine.backend import Backend, Generation, GenerationResult, Request


@dataclass
class Ticket:
    """A submitted request; `result` is set once it has run, `error` if it could not."""

    request_id: int
    request: Request
    generation: Generation | None = None
    result: GenerationResult | None = None
    error: Exception | None = None

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


class Scheduler:
    def __init__(self, backend: Backend, max_running: int = 1) -> None:
        self.backend = backend
        self.max_running = max_running
        self.pending: deque[Ticket] = deque()
        self.running: list[Ticket] = []
        self._ids = itertools.count()

    def submit(self, request: Request) -> Ticket:
        ticket = Ticket(next(self._ids), request)
        self.pending.append(ticket)
        return ticket

    def admit_pending(self) -> list[Ticket]:
        """Move pending requests into the running set while there is room; each admission
        looks its prompt up in the cache. Requests that cannot start get their error."""
        admitted = []
        while self.pending and len(self.running) < self.max_running:
            ticket = self.pending.popleft()
            try:
                ticket.generation = self.backend.start(ticket.request)
            except Exception as exc:  # a bad request must not stop the queue
                ticket.error = exc
                continue
            self.running.append(ticket)
            admitted.append(ticket)
        return admitted

    def step(self, on_text: Callable[[Ticket, str], None] | None = None) -> list[Ticket]:
        """Admit, then run the running requests to completion; returns the finished ones."""
        self.admit_pending()
        finished = []
        for ticket in self.running:
            assert ticket.generation is not None
            for delta in ticket.generation:
                if on_text is not None:
                    on_text(ticket, delta)
            ticket.result = ticket.generation.result
            finished.append(ticket)
        self.running = [t for t in self.running if not t.done]
        return finished

    def run(self, on_text: Callable[[Ticket, str], None] | None = None) -> None:
        """Drain the queue."""
        while self.pending or self.running:
            self.step(on_text)

    def abort(self) -> None:
        """Stop everything (Ctrl-C): running requests store what they computed; pending ones
        never start."""
        for ticket in self.running:
            if ticket.generation is not None:
                ticket.generation.close()
                ticket.result = ticket.generation.result
        self.running = []
        self.pending.clear()
