"""kvchat's own API: POST /generate (a prompt, messages or a session turn) and GET /healthz."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

from fastapi import APIRouter, Request

from kvchat.responses import result_fields
from kvchat.server.auth import Caller, Tenant
from kvchat.server.errors import error_response
from kvchat.server.handle import Handle
from kvchat.server.pinning import PinJob
from kvchat.server.pins_api import pin_job
from kvchat.server.prepare import Sessions
from kvchat.server.schemas import GenerateBody
from kvchat.server.sse import EventStream, error_event, sse, wait_result
from kvchat.server.state import State
from kvchat.turns import PreparedTurn

router = APIRouter()


@router.post("/generate", response_model=None)
async def generate(body: GenerateBody, request: Request, state: State, tenant: Caller) -> Any:
    """Generate a reply; with "stream": true, server-sent events: `token` events with text
    deltas, then one `done` event with the stats (or an `error` event). With "pin", the
    request's system prefix ("system", true) or prompt and reply ("all") is pinned once it
    is stored; the reply's "pin" says how that went."""
    lock = None
    if body.session is not None:
        lock = state.sessions.of(tenant).turn_locks.setdefault(body.session, asyncio.Lock())
        await lock.acquire()
    return await reply(body, request, state, tenant, lock)


async def reply(body: GenerateBody, request: Request, state: State, tenant: Tenant,
                lock: asyncio.Lock | None, undo: Callable[[], None] | None = None) -> Any:
    """Run a /generate body whose session's turn lock (if any) the caller holds; the lock is
    released once the turn is recorded. `undo` runs, before that, when the turn does not
    happen (a retry puts back the reply it rewound)."""
    sessions = state.sessions.of(tenant)
    try:
        namespace = state.gate.namespace(tenant, body.cache_salt)
        job = pin_job(state, body.pin, tenant, namespace)
        prepare = partial(_prepare, state, sessions, job)
        handle = await state.start(prepare, body, tenant, namespace,
                                   job.after if job is not None else None)
    except BaseException:
        if undo is not None:
            undo()
        if lock is not None:
            lock.release()
        raise
    if undo is not None:
        handle.on_done(lambda: None if handle.result is not None else undo())
    if lock is not None:
        handle.on_done(lock.release)
    if not body.stream:
        result = await wait_result(handle, request)
        return {**result_fields(result), **_pinned(job), **_session(handle, body.session)}
    return EventStream(_events(handle, body.session, job), handle)


def _prepare(state: State, sessions: Sessions, job: PinJob | None,
             body: GenerateBody) -> PreparedTurn:
    turn = state.preparer.generate(body, sessions)
    return turn if job is None else job.prepared(turn)


def _pinned(job: PinJob | None) -> dict[str, Any]:
    return {"pin": job.outcome} if job is not None and job.outcome is not None else {}


def _session(handle: Handle, name: str | None) -> dict[str, Any]:
    """A session turn's name, and why its file could not be saved when it was not (the turn
    ran; the session on disk is behind it)."""
    if name is None:
        return {}
    failed = {"session_error": handle.session_error} if handle.session_error else {}
    return {"session": name, **failed}


async def _events(handle: Handle, session: str | None, job: PinJob | None
                  ) -> AsyncIterator[bytes]:
    async for delta in handle.stream():
        yield sse({"text": delta}, "token")
    if handle.error is not None:
        yield sse(error_event(handle.error), "error")
    elif handle.result is not None:
        done = {**result_fields(handle.result), **_pinned(job), **_session(handle, session)}
        yield sse(done, "done")


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
    return {"status": "ok", "model": model, "device": worker.info.device,
            "precision": worker.info.precision, "chat_template": worker.codec.has_template,
            "batch_size": worker.engine.batch_size,
            "keep_interrupted": True}  # /generate takes "keep_interrupted" (kvchat batch asks)
