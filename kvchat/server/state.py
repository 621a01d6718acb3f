"""What every endpoint shares, stored once on `app.state.server`: the engine worker, request
preparation, the gate (credentials -> tenant) and each tenant's sessions. Handlers receive it as
a `State` parameter."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from kvchat.engine.sequence import GenerationResult
from kvchat.server.auth import Gate, Tenant
from kvchat.server.errors import api_error
from kvchat.server.handle import Handle
from kvchat.server.prepare import Preparer, TenantSessions
from kvchat.server.worker import EngineStopped, EngineWorker
from kvchat.turns import PreparedTurn

T = TypeVar("T")
B = TypeVar("B")


@dataclass
class ServerState:
    worker: EngineWorker
    sessions: TenantSessions
    preparer: Preparer
    gate: Gate
    completion_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    # pin id -> the tenants that asked for it (engine thread only; see `pins_api`)
    pin_owners: dict[str, set[str]] = field(default_factory=dict)

    async def start(self, prepare: Callable[[B], PreparedTurn], body: B, tenant: Tenant,
                    namespace: str, after: Callable[[GenerationResult], None] | None = None,
                    affinity: str | None = None) -> Handle:
        """Prepare the request in a worker thread and hand it to the engine, cached in
        `namespace`, explained as `tenant` may see that namespace (`Tenant.sees`) and counted
        for `tenant` (and, without a session, under the router's `affinity` key: `fleet_api`);
        any failure becomes the HTTP error the client sees. `after` runs on the engine thread
        once the result is stored (see `Handle`)."""
        try:
            turn = await run_in_threadpool(prepare, body)
            request = replace(turn.request(namespace), visibility=tenant.sees(namespace))
            if request.sid is not None or affinity is not None:
                request = replace(request, sid=tenant.sid(request.sid or str(affinity)))
            handle = Handle(turn, self.sessions.of(tenant).store, request, tenant.id, after)
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
