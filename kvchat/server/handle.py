"""One request as the server's event loop sees it (`Handle`): the engine thread posts its text
and its end into an asyncio queue with `loop.call_soon_threadsafe`; a cancel from any thread
reaches the engine's own handle once the request is in the engine."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvchat.engine.handle import RequestHandle
from kvchat.engine.sequence import GenerationResult, Request
from kvchat.sessions import SessionStore
from kvchat.turns import PreparedTurn


class Handle:
    """One request as the event loop sees it. The engine thread calls `text`, `finish` and
    `fail`; the loop reads `deltas` (None ends them), then `result` or `error`. `request` is
    what the engine runs (the turn's, unless the caller's tenant set its namespace and session
    id); `tenant` is whose counters it adds to. `after` runs on the engine thread once the
    request's tokens are stored, before the result is delivered (a `pin` option uses it: the
    prefix cannot be evicted in between)."""

    def __init__(self, turn: PreparedTurn, store: SessionStore | None = None,
                 request: Request | None = None, tenant: str = "",
                 after: Callable[[GenerationResult], None] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.turn = turn
        self.request = request if request is not None else turn.request()
        self.tenant = tenant
        self.store = store  # where a session turn's transcript is saved
        self.after = after
        self.deltas: asyncio.Queue[str | None] = asyncio.Queue()
        self.done = asyncio.Event()
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.cancel_event = threading.Event()
        self.session_error: str | None = None  # the session's file could not be saved
        self._callbacks: list[Callable[[], None]] = []
        self._engine_handle: RequestHandle | None = None

    # engine thread
    def text(self, delta: str) -> None:
        self._post(self.deltas.put_nowait, delta)

    def finish(self, result: GenerationResult) -> None:
        self._post(self._resolve, result, None)

    def fail(self, error: BaseException) -> None:
        self._post(self._resolve, None, error)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self.loop.call_soon_threadsafe(fn, *args)

    # event loop
    def _resolve(self, result: GenerationResult | None, error: BaseException | None) -> None:
        self.result, self.error = result, error
        self.deltas.put_nowait(None)
        self.done.set()
        for callback in self._callbacks:
            callback()

    def on_done(self, callback: Callable[[], None]) -> None:
        if self.done.is_set():
            callback()
        else:
            self._callbacks.append(callback)

    async def stream(self) -> AsyncIterator[str]:
        while (delta := await self.deltas.get()) is not None:
            yield delta

    def attach(self, engine_handle: RequestHandle) -> None:
        """The request is in the engine (engine thread); a cancel that came first still counts."""
        self._engine_handle = engine_handle
        if self.cancel_event.is_set():
            engine_handle.cancel()

    @property
    def request_id(self) -> int | None:
        """The engine's id for the request, once it is in the engine."""
        return None if self._engine_handle is None else self._engine_handle.request_id

    # any thread
    def cancel(self) -> None:
        """Stop at the next step (or before it starts); a no-op once finished."""
        self.cancel_event.set()
        if self._engine_handle is not None:
            self._engine_handle.cancel()
