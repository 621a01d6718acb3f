"""The request body limit, enforced before a body is parsed."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as AsgiMessage

from kvchat.server.errors import error_response

# Far above any prompt a model's context holds; stops a runaway body before it is parsed.
MAX_BODY_BYTES = 8 * 1024 * 1024


class BodyLimit:
    """Refuse request bodies over `limit` bytes with a JSON 413, whether the size is declared
    (Content-Length) or only seen while reading."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"The request body is larger than {self.limit:,} bytes."
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            await error_response(413, "request_too_large", message)(scope, receive, send)
            return
        seen = 0

        async def limited() -> AsgiMessage:
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, message)
            return msg

        await self.app(scope, limited, send)
