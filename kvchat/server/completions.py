"""POST /v1/completions: OpenAI's (legacy) completions, as vLLM serves them: a plain prompt
with any model, a chat template or not (a base model's way in; /v1/chat/completions needs a
template)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request

from kvchat.responses import openai_finish_reason, text_completion, usage
from kvchat.server.auth import Caller
from kvchat.server.fleet_api import affinity
from kvchat.server.handle import Handle
from kvchat.server.openai import extension
from kvchat.server.schemas import CompletionBody
from kvchat.server.sse import EventStream, error_event, sse, wait_result
from kvchat.server.state import State

router = APIRouter()


@dataclass(frozen=True)
class TextChunks:
    """The text_completion events of one streamed completion."""

    completion_id: str
    created: int
    model: str

    def chunk(self, text: str, finish: str | None = None) -> bytes:
        return sse({"id": self.completion_id, "object": "text_completion",
                    "created": self.created, "model": self.model,
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": finish}]})


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionBody, request: Request, state: State,
                      tenant: Caller) -> Any:
    """The OpenAI completions subset: prompt (text or token ids), max_tokens, temperature,
    top_p, seed, stop, stream (text_completion events, then `data: [DONE]`); the reply carries
    kvchat's own fields under "kvchat" (and a stream's usage chunk, with include_usage)."""
    namespace = state.gate.namespace(tenant, body.cache_salt)
    handle = await state.start(state.preparer.completion, body, tenant, namespace,
                               affinity=affinity(request))
    completion_id = f"cmpl-kvchat-{next(state.completion_ids)}"
    name = state.worker.info.model_id
    if not body.stream:
        result = await wait_result(handle, request)
        return {**text_completion(result, completion_id, name), "kvchat": extension(result, None)}
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    chunks = TextChunks(completion_id, int(time.time()), name)
    return EventStream(_events(handle, chunks, include_usage), handle)


async def _events(handle: Handle, chunks: TextChunks, include_usage: bool
                  ) -> AsyncIterator[bytes]:
    async for delta in handle.stream():
        yield chunks.chunk(delta)
    if handle.error is not None:
        yield sse(error_event(handle.error))
    elif handle.result is not None:
        result = handle.result
        yield chunks.chunk("", openai_finish_reason(result.finish_reason))
        if include_usage:
            yield sse({"id": chunks.completion_id, "object": "text_completion",
                       "created": chunks.created, "model": chunks.model, "choices": [],
                       "usage": usage(result), "kvchat": extension(result, None)})
    yield b"data: [DONE]\n\n"
