"""POST /cache/explain: why a prompt would (not) be served from the live cache, as a new
conversation's first turn, in the caller's namespace: what `kvchat inspect --explain
--connect URL` shows for a kvchat server (without --connect it reads the saved snapshot).

The answer is the one `kvchat.cache.explain` gives the engine for a request's miss: cold,
evicted (when, by which policy) or diverged at token i. A tenant sees what the cache holds
after a divergence only in its private namespace (`Tenant.sees`): in a shared one
(`--share-cache`, a `cache_salt` group) those tokens may be another tenant's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from kvchat.cache.explain import Explanation
from kvchat.cache.visibility import Visibility
from kvchat.inspect.explain import PromptExplanation, PromptSpec, explanation_detail
from kvchat.server.auth import Caller
from kvchat.server.errors import api_error
from kvchat.server.schemas import Message
from kvchat.server.state import State

router = APIRouter()


class ExplainBody(BaseModel):
    """The prompt to explain: chat `messages` (templated as a first turn), or `prompt`, the
    exact prompt text (no template)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    messages: list[Message] | None = Field(None, min_length=1)
    prompt: str | None = None
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _one_input(self) -> ExplainBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError('give exactly one of "messages" or "prompt"')
        return self


@router.post("/cache/explain")
async def explain(body: ExplainBody, state: State, tenant: Caller) -> dict[str, Any]:
    """The explanation (`miss_reason`, `cached_tokens`, `diverged_at`, evicted_*), its
    `detail` (decoded text around where the cached prefix ends) and its `line` for people."""
    namespace = state.gate.namespace(tenant, body.cache_salt)
    codec = state.worker.codec
    if body.messages is not None:
        spec = PromptSpec(tuple(m.model_dump() for m in body.messages))
    else:
        spec = PromptSpec(raw=body.prompt)
    try:
        ids = await run_in_threadpool(
            lambda: codec.encode(spec.raw) if spec.raw is not None
            else codec.encode_chat(list(spec.messages)))
    except Exception as exc:
        raise api_error(exc) from exc
    cache = state.worker.engine.cache
    assert cache is not None  # the worker refuses a runtime without one

    def read() -> tuple[Explanation, int]:
        exact = cache.exact.has(ids, namespace)
        return cache.explain(ids, namespace, exact), len(cache.tombstones)

    why, tombstones = await state.on_engine(lambda: state.worker.call(read))
    # what this caller may see of that namespace (a cache_salt group's is shared even for a
    # tenant whose own namespace is private); the rule `miss_detail` follows too
    sees = tenant.sees(namespace)
    if sees is not Visibility.CACHE:  # others' tokens: say where, not what
        why = replace(why, cached_next=())

    def decode(tokens: list[int]) -> str:
        return codec.decode(tokens, skip_special_tokens=False)

    result = PromptExplanation(why, tuple(ids), why.describe(ids, decode, sees),
                               explanation_detail(why, ids, decode, spec, tombstones, sees))
    return {**result.to_json(), "line": result.line, "prompt_tokens": len(ids)}
