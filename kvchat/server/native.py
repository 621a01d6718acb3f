"""kvchat's own API: POST /generate (a prompt, messages or a session turn) and GET /healthz."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import APIRouter, Request

from kvchat.responses import result_fields
from kvchat.server.auth import Caller, Tenant
from kvchat.server.errors import error_response
from kvchat.server.schemas import GenerateBody
from kvchat.server.sse import EventStream, error_event, sse, wait_result
from kvchat.server.state import State
from kvchat.server.worker import Handle

router = APIRouter()


@router.post("/generate", response_model=None)
async def generate(body: GenerateBody, request: Request, state: State, tenant: Caller) -> Any:
    """Generate a reply; with "stream": true, server-sent events: `token` events with text
    deltas, then one `done` event with the stats (or an `error` event)."""
    namespace = state.gate.namespace(tenant, body.cache_salt)
    sessions = state.sessions.of(tenant)
    lock = None
    if body.session is not None:
        lock = sessions.turn_locks.setdefault(body.session, asyncio.Lock())
        await lock.acquire()
    try:
        prepare = partial(state.preparer.generate, sessions=sessions)
        handle = await state.start(prepare, body, tenant, namespace)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if lock is not None:
        handle.on_done(lock.release)
    extra = {"session": body.session} if body.session else {}
    if not body.stream:
        return {**result_fields(await wait_result(handle, request)), **extra}
    return EventStream(_events(handle, extra), handle)


async def _events(handle: Handle, extra: dict[str, Any]) -> AsyncIterator[bytes]:
    async for delta in handle.stream():
        yield sse({"text": delta}, "token")
    if handle.error is not None:
        yield sse(error_event(handle.error), "error")
    elif handle.result is not None:
        yield sse({**result_fields(handle.result), **extra}, "done")


@router.get("/healthz", response_model=None)
async def healthz(request: Request, state: State) -> Any:
    """Open to anyone: liveness, and the model's name (its full label, a local path maybe,
    only for the admin)."""
    worker = state.worker
    if not worker.alive:
        return error_response(503, "unavailable", "The engine thread is not running.")
    tenant = getattr(request.state, "tenant", None)
    admin = isinstance(tenant, Tenant) and tenant.admin
    model = worker.info.label if admin else worker.info.model_id
    return {"status": "ok", "model": model, "device": worker.info.device}
