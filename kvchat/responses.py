"""How kvchat reports one finished request, in its own shape and in OpenAI's: the server's
replies and `kvchat batch`'s output rows use these."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvchat.engine.result import GenerationResult  # torch-free: an attached batch loads no engine

if TYPE_CHECKING:
    from kvchat.sessions import Turn


def result_fields(r: GenerationResult) -> dict[str, Any]:
    """What kvchat reports about one request: a batch output line, the server's /generate."""
    return {
        "text": r.text,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cache_hit_tokens": r.cache_hit_tokens,  # from both tiers
        "disk_hit_tokens": r.disk_hit_tokens,
        "shared_hit_tokens": r.shared_hit_tokens,  # blocks other instances put in a shared store
        "hit_source": r.hit_source,
        "miss_reason": r.miss_reason,  # why the cached prefix ended there (`kvchat.cache.explain`)
        "miss_label": r.miss_label,  # the same for people: "new", "shared prefix", ...
        "diverged_at": r.diverged_at,
        "miss_detail": r.miss_detail,
        "finish_reason": r.finish_reason,
        "draft_tokens": r.draft_tokens,  # tokens the cache proposed (`kvchat.cache.drafts`)
        "draft_accepted": r.draft_accepted,  # of those, the ones verification kept
        "replayed_tokens": r.replayed_tokens,  # taken from a stored greedy reply, no forward
        "ttft_ms": round(r.ttft_ms, 2),
        "total_ms": round(r.total_ms, 2),
    }


def result_from_fields(doc: Mapping[str, Any]) -> GenerationResult:
    """A kvchat server's reply (`result_fields`, as /generate sends it) read back into the
    result it reports, so `result_fields` of it is the reply's own fields again. The reply has
    no token ids (their count is kept), no stored tokens and no decode rate; its time to first
    token includes queueing, so it stands for the prefill time as an upper bound."""
    prompt, hit = int(doc["prompt_tokens"]), int(doc["cache_hit_tokens"])
    return GenerationResult(
        text=doc["text"], token_ids=[], prompt_tokens=prompt, cache_hit_tokens=hit,
        hit_source=doc["hit_source"], computed_tokens=prompt - hit,
        prefill_ms=float(doc["ttft_ms"]), ttft_ms=float(doc["ttft_ms"]),
        decode_tokens_per_s=0.0, total_ms=float(doc["total_ms"]),
        finish_reason=doc["finish_reason"], stored_tokens=0,
        disk_hit_tokens=doc["disk_hit_tokens"], shared_hit_tokens=doc["shared_hit_tokens"],
        miss_reason=doc["miss_reason"], diverged_at=doc["diverged_at"],
        miss_detail=doc["miss_detail"], miss_label=doc["miss_label"],
        draft_tokens=doc["draft_tokens"], draft_accepted=doc["draft_accepted"],
        replayed_tokens=int(doc.get("replayed_tokens") or 0),  # an earlier server: none
        reported_completion_tokens=int(doc["completion_tokens"]))


def result_from_turn(turn: Turn, decode_tokens_per_s: float = 0.0) -> GenerationResult:
    """The result as a session's record of the turn holds it: what the chat shows of a reply
    another engine reported (or a server's turn whose last event never came). Nothing in the
    record says why the cached prefix ended where it did: those fields are empty."""
    return GenerationResult(
        text="", token_ids=[], prompt_tokens=turn.prompt_tokens,
        cache_hit_tokens=turn.hit_tokens, hit_source=turn.source,
        computed_tokens=turn.prompt_tokens - turn.hit_tokens, prefill_ms=turn.prefill_ms,
        ttft_ms=turn.ttft_ms, decode_tokens_per_s=decode_tokens_per_s, total_ms=0.0,
        finish_reason=turn.finish_reason, stored_tokens=0, miss_reason="", miss_label="",
        reported_completion_tokens=turn.completion_tokens)


def openai_finish_reason(reason: str) -> str:
    # OpenAI has no "interrupted": the reply simply ends where it was stopped
    return reason if reason in ("stop", "length") else "stop"


def chat_completion(r: GenerationResult, completion_id: str, model: str = "kvchat") -> (
    dict[str, Any]
):
    """An OpenAI `chat.completion` object; `usage.prompt_tokens_details.cached_tokens` carries
    the cache hit."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text},
                     "finish_reason": openai_finish_reason(r.finish_reason)}],
        "usage": usage(r),
    }


def text_completion(r: GenerationResult, completion_id: str, model: str = "kvchat") -> (
    dict[str, Any]
):
    """An OpenAI (legacy) `text_completion` object, as /v1/completions answers."""
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": r.text, "logprobs": None,
                     "finish_reason": openai_finish_reason(r.finish_reason)}],
        "usage": usage(r),
    }


def usage(r: GenerationResult) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` carries the cache hit."""
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": r.prompt_tokens + r.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": r.cache_hit_tokens},
    }
