"""Delivering a reply: server-sent events for streams, or the whole result for the rest. Either
way a client that goes away cancels its request, which stops at the next engine step."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvchat.engine.sequence import GenerationResult
from kvchat.server.errors import ApiError, api_error
from kvchat.server.handle import Handle


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def error_event(error: BaseException) -> dict[str, Any]:
    """The data of a stream's last event when its request failed."""
    err = api_error(error)
    return {"error": {"message": err.message, "type": err.kind}}


class EventStream(StreamingResponse):
    """Server-sent events for one request, which is cancelled however the response ends (a
    client that disconnects stops its generation at the next step)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], handle: Handle) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        self.handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def wait_result(handle: Handle, request: Request) -> GenerationResult:
    """The finished result; the request is cancelled if the client disconnects first."""
    done = asyncio.ensure_future(handle.done.wait())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        done.cancel()
        gone.cancel()
        if not handle.done.is_set():
            handle.cancel()
    if not handle.done.is_set():
        raise ApiError(499, "cancelled", "The client closed the connection.")
    if handle.error is not None:
        raise api_error(handle.error)
    assert handle.result is not None
    return handle.result
