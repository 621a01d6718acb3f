"""The kvchat HTTP app: one engine worker, the shared state, the gate, the error shape and the
routers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from kvchat import __version__
from kvchat.runtime import Runtime
from kvchat.server import (
    cache_api,
    completions,
    explain_api,
    fleet_api,
    metrics,
    moves_api,
    native,
    openai,
    pins_api,
    sessions_api,
)
from kvchat.server.auth import Auth, AuthGate, Gate
from kvchat.server.errors import add_error_handlers
from kvchat.server.limits import MAX_BODY_BYTES, BodyLimit
from kvchat.server.prepare import DEFAULT_MAX_TOKENS, Preparer, TenantSessions
from kvchat.server.state import ServerState
from kvchat.server.worker import DEFAULT_BATCH_SIZE, EngineWorker


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start the engine thread; on shutdown, stop it and save the cache snapshot."""
    worker: EngineWorker = app.state.engine
    worker.start()
    try:
        yield
    finally:
        await asyncio.to_thread(worker.close_and_report)


def create_app(
    runtime: Runtime,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    auth: Auth | None = None,
) -> FastAPI:
    """The kvchat HTTP app over one runtime. Its lifespan starts the engine thread and, on
    shutdown, stops it and saves the cache snapshot. `app.state.engine` is the EngineWorker
    (whoever runs the app may `close()` it again: it is idempotent).

    `auth` says who may call it (see `kvchat.server.auth`); None is no authentication at all,
    every caller the admin: for tests and for embedding behind a gate of one's own."""
    gate = Gate(auth or Auth(), runtime.options.sessions_dir)
    worker = EngineWorker(runtime, batch_size)
    app = FastAPI(title="kvchat", version=__version__, lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    app.add_middleware(AuthGate, gate=gate)  # the outer one: no body is read for a stranger
    app.state.engine = worker
    app.state.runtime = runtime
    app.state.server = ServerState(worker, TenantSessions(worker.store),
                                   Preparer(worker.engine, max_tokens), gate)
    add_error_handlers(app)
    for api in (native, openai, completions, cache_api, explain_api, pins_api, sessions_api,
                moves_api, metrics, fleet_api):
        app.include_router(api.router)
    return app
