"""The OpenAI-compatible subset: POST /v1/chat/completions and GET /v1/models."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import APIRouter, Request

from kvchat.engine.sequence import GenerationResult
from kvchat.responses import chat_completion, openai_finish_reason
from kvchat.server.auth import Caller
from kvchat.server.fleet_api import affinity
from kvchat.server.handle import Handle
from kvchat.server.pinning import PinJob
from kvchat.server.pins_api import pin_job
from kvchat.server.schemas import ChatCompletionBody
from kvchat.server.sse import EventStream, error_event, sse, wait_result
from kvchat.server.state import ServerState, State
from kvchat.turns import PreparedTurn

router = APIRouter()


@dataclass(frozen=True)
class Chunks:
    """The chat.completion.chunk events of one streamed completion."""

    completion_id: str
    created: int
    model: str
    usage: bool  # stream_options.include_usage: every chunk carries "usage", the last one set

    def delta(self, delta: dict[str, str], finish: str | None = None) -> bytes:
        data: dict[str, Any] = {
            "id": self.completion_id, "object": "chat.completion.chunk",
            "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish}],
        }
        if self.usage:
            data["usage"] = None
        return sse(data)

    def usage_chunk(self, result: GenerationResult, job: PinJob | None) -> bytes:
        return sse({"id": self.completion_id, "object": "chat.completion.chunk",
                    "created": self.created, "model": self.model, "choices": [],
                    "usage": chat_completion(result, self.completion_id)["usage"],
                    "kvchat": extension(result, job)})


def extension(result: GenerationResult, job: PinJob | None) -> dict[str, Any]:
    """kvchat's own fields of a chat completion, under "kvchat" (OpenAI clients ignore
    unknown fields): why the cached prefix ended where it did, and the pin asked for."""
    doc: dict[str, Any] = {"miss_reason": result.miss_reason, "miss_label": result.miss_label,
                           "diverged_at": result.diverged_at,
                           "miss_detail": result.miss_detail,
                           "cache_hit_tokens": result.cache_hit_tokens}
    if job is not None and job.outcome is not None:
        doc["pin"] = job.outcome
    return doc


def _prepare(state: ServerState, job: PinJob | None, body: ChatCompletionBody) -> PreparedTurn:
    turn = state.preparer.chat(body)
    return turn if job is None else job.prepared(turn)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionBody, request: Request, state: State,
                           tenant: Caller) -> Any:
    """The OpenAI chat completions subset: messages, max_tokens, temperature, top_p, seed,
    stop, stream (chat.completion.chunk events, then `data: [DONE]`). Replies carry kvchat's
    own fields under "kvchat" (the last chunk of a stream with include_usage); kvchat's `pin`
    option is reported there."""
    namespace = state.gate.namespace(tenant, body.cache_salt)
    job = pin_job(state, body.pin, tenant, namespace)
    handle = await state.start(partial(_prepare, state, job), body, tenant, namespace,
                               job.after if job is not None else None, affinity(request))
    completion_id = f"chatcmpl-kvchat-{next(state.completion_ids)}"
    name = state.worker.info.model_id
    if not body.stream:
        result = await wait_result(handle, request)
        return {**chat_completion(result, completion_id, name),
                "kvchat": extension(result, job)}
    usage = body.stream_options is not None and body.stream_options.include_usage
    chunks = Chunks(completion_id, int(time.time()), name, usage)
    return EventStream(_events(handle, chunks, job), handle)


async def _events(handle: Handle, chunks: Chunks, job: PinJob | None) -> AsyncIterator[bytes]:
    yield chunks.delta({"role": "assistant", "content": ""})
    async for delta in handle.stream():
        yield chunks.delta({"content": delta})
    if handle.error is not None:
        yield sse(error_event(handle.error))
    elif handle.result is not None:
        result = handle.result
        yield chunks.delta({}, openai_finish_reason(result.finish_reason))
        if chunks.usage:
            yield chunks.usage_chunk(result, job)
    yield b"data: [DONE]\n\n"


@router.get("/v1/models")
async def models(state: State) -> dict[str, Any]:
    name = state.worker.info.model_id
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": 0, "owned_by": "kvchat"}]}
