"""kvchat's own API: POST /generate (a prompt, messages or a session turn) and GET /healthz."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from kvchat.responses import result_fields
from kvchat.server.errors import error_response
from kvchat.server.schemas import GenerateBody
from kvchat.server.sse import EventStream, error_event, sse, wait_result
from kvchat.server.state import State
from kvchat.server.worker import Handle

router = APIRouter()


@router.post("/generate", response_model=None)
async def generate(body: GenerateBody, request: Request, state: State) -> Any:
    """Generate a reply; with "stream": true, server-sent events: `token` events with text
    deltas, then one `done` event with the stats (or an `error` event)."""
    lock = None
    if body.session is not None:
        lock = state.sessions.turn_locks.setdefault(body.session, asyncio.Lock())
        await lock.acquire()
    try:
        handle = await state.start(state.preparer.generate, body)
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
async def healthz(state: State) -> Any:
    worker = state.worker
    if not worker.alive:
        return error_response(503, "unavailable", "The engine thread is not running.")
    return {"status": "ok", "model": worker.info.label, "device": worker.info.device}
