"""Chat turns over a session's own token history.

Turn N+1's prompt is the exact tokens the model saw in turn N (prompt + reply) plus the chat
template's text for the new user message, so the whole history is a cache hit. Re-tokenising
the transcript instead could split differently and silently break reuse.
"""

from __future__ import annotations

from kvchat.engine.backend import Backend, GenerationResult
from kvchat.sessions import Session, Turn


def conversation(session: Session, user_text: str | None = None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": session.system}] if session.system else []
    messages += session.messages
    if user_text is not None:
        messages.append({"role": "user", "content": user_text})
    return messages


def next_prompt(backend: Backend, session: Session, user_text: str) -> list[int]:
    """Token ids for the next turn: the session's history extended by the new user message."""
    messages = conversation(session, user_text)
    if not session.tokens:
        return backend.encode_chat(messages)
    full = backend.render_chat(messages, add_generation_prompt=True)
    seen = backend.decode(session.tokens, skip_special_tokens=False)
    if full.startswith(seen):
        return session.tokens + backend.encode(full[len(seen) :])
    # the template rewrote earlier turns (e.g. trimmed a reply): start from the transcript; the
    # cache still serves whatever prefix is unchanged
    return backend.encode_chat(messages)


def record_turn(
    session: Session, user_text: str, prompt_ids: list[int], result: GenerationResult
) -> Turn:
    session.messages.append({"role": "user", "content": user_text})
    session.messages.append({"role": "assistant", "content": result.text})
    session.tokens = list(prompt_ids) + list(result.token_ids)
    turn = Turn(
        prompt_tokens=result.prompt_tokens,
        hit_tokens=result.cache_hit_tokens,
        source=result.hit_source,
        completion_tokens=result.completion_tokens,
        ttft_ms=round(result.ttft_ms, 2),
        prefill_ms=round(result.prefill_ms, 2),
        finish_reason=result.finish_reason,
    )
    session.turns.append(turn)
    return turn
