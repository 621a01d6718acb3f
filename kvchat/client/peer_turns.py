"""A conversation's turn on a remote engine (an OpenAI-compatible server other than kvchat's
own): the messages it sends, the request body, and the reply recorded in the session as the
engine reported it. Torch-free.

Such an engine templates and tokenises the messages itself, so the session's token history is
left as it was: it stays a prefix of the conversation's rendering, which a later turn in kvchat
(standalone or on a kvchat server) extends, re-templating only what was said since. The turn's
counts are the engine's (`Turn.reported_by`), its TTFT this client's own measurement.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvchat.client.openai_http import Completion, Usage
from kvchat.config import SamplingParams
from kvchat.errors import KvchatError
from kvchat.sessions import Session, Turn

Message = dict[str, str]


def conversation(session: Session, user_text: str | None = None) -> list[Message]:
    """The messages a turn sends: the system prompt, the history, the new user message."""
    messages = [{"role": "system", "content": session.system}] if session.system else []
    messages += [dict(m) for m in session.messages]
    if user_text is not None:
        messages.append({"role": "user", "content": user_text})
    return messages


def begin(session: Session, earlier: Sequence[Message], system: str | None) -> None:
    """A session line's earlier messages (and `system`) start a new session, as in kvchat's
    own turns; a session with history takes only its new user message."""
    if earlier:
        if session.messages:
            raise KvchatError("a later turn of a session gives only its new user message")
        session.system = next((m["content"] for m in earlier if m["role"] == "system"), None)
        session.messages = [dict(m) for m in earlier if m["role"] != "system"]
    if system is not None:
        session.system = system


def request_body(model: str, messages: Sequence[Message], params: SamplingParams
                 ) -> dict[str, Any]:
    """An OpenAI chat completions body; top_k and seed only when set (not every engine takes
    top_k, and a missing seed is the engine's own choice)."""
    body: dict[str, Any] = {"model": model, "messages": list(messages),
                            "max_tokens": params.max_new_tokens,
                            "temperature": params.temperature, "top_p": params.top_p}
    if params.top_k:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    return body


def turn_of(reply: Completion | None, text: str, ttft_ms: float | None, engine: str,
            start_tokens: int) -> Turn:
    """The session's record of a turn: the engine's counts (0 where it reported none; the
    source says whether it did), or for a reply stopped early only what this client saw."""
    usage = reply.usage if reply is not None else Usage(None, None, None)
    return Turn(
        prompt_tokens=usage.prompt_tokens or 0,
        hit_tokens=usage.cached_tokens or 0,
        source="reported" if usage.cached_tokens is not None else "unreported",
        completion_tokens=usage.completion_tokens or 0,
        ttft_ms=round(ttft_ms or 0.0, 2),
        prefill_ms=round(usage.prefill_ms or 0.0, 2),
        finish_reason=reply.finish_reason if reply is not None else "interrupted",
        start_tokens=start_tokens,
        reported_by=engine,
    )


def record(session: Session, user_text: str, reply: Completion | None, text: str,
           ttft_ms: float | None, engine: str) -> Turn:
    """Append the turn (the user's message, the reply as far as it came) to the session."""
    turn = turn_of(reply, text, ttft_ms, engine, len(session.tokens))
    session.messages.append({"role": "user", "content": user_text})
    session.messages.append({"role": "assistant", "content": text})
    session.turns.append(turn)
    return turn
