"""What every endpoint shares, stored once on `app.state.server`: the engine worker, request
preparation and the session registry. Handlers receive it as a `State` parameter."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from kvchat.server.errors import api_error
from kvchat.server.prepare import Preparer, Sessions
from kvchat.server.worker import EngineStopped, EngineWorker, Handle
from kvchat.turns import PreparedTurn

T = TypeVar("T")
B = TypeVar("B")


@dataclass
class ServerState:
    worker: EngineWorker
    sessions: Sessions
    preparer: Preparer
    completion_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    async def start(self, prepare: Callable[[B], PreparedTurn], body: B) -> Handle:
        """Prepare the request in a worker thread and hand it to the engine; any failure
        becomes the HTTP error the client sees."""
        try:
            handle = Handle(await run_in_threadpool(prepare, body), self.sessions.store)
            self.worker.submit(handle)
        except Exception as exc:
            raise api_error(exc) from exc
        return handle

    async def on_engine(self, read: Callable[[], Future[T]]) -> T:
        """Await a read the worker runs on the engine thread (503 once it has stopped)."""
        try:
            return await asyncio.wrap_future(read())
        except EngineStopped as exc:
            raise api_error(exc) from exc


def server_state(request: Request) -> ServerState:
    state: Any = request.app.state.server
    assert isinstance(state, ServerState)
    return state


State = Annotated[ServerState, Depends(server_state)]
