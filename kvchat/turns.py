"""A turn, the same for every front end: what was asked -> prompt ids and sampling parameters
(`prepare_turn`); then `finish`: the result commits to the session's history, the session is
saved and a pin applied, or the turn is aborted and changes nothing.

Turn N+1's prompt in a session is the exact tokens the model saw in turn N (prompt + reply) plus
the chat template's text for the new user message, so the whole history is a cache hit.
Re-tokenising the transcript instead could split differently and silently break reuse.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

from kvchat.cache.radix import common_prefix
from kvchat.config import SamplingParams
from kvchat.engine.codec import ChatCodec
from kvchat.engine.sequence import Finished, GenerationResult, Request
from kvchat.errors import KvchatError
from kvchat.sessions import Session, Turn

Message = dict[str, str]


class TurnError(KvchatError):
    """A request whose messages cannot make a turn (e.g. a session turn not ending with the
    user's message)."""


def conversation(session: Session, user_text: str | None = None) -> list[Message]:
    messages = [{"role": "system", "content": session.system}] if session.system else []
    messages += session.messages
    if user_text is not None:
        messages.append({"role": "user", "content": user_text})
    return messages


def next_prompt(codec: ChatCodec, session: Session, user_text: str) -> list[int]:
    """Token ids for the next turn: the session's history extended by the new user message."""
    messages = conversation(session, user_text)
    if not session.tokens:  # a conversation even when it is one message (no plain prompt)
        return codec.encode(codec.render_chat(messages, add_generation_prompt=True))
    full = codec.render_chat(messages, add_generation_prompt=True)
    seen = codec.decode(session.tokens, skip_special_tokens=False)
    if full.startswith(seen):
        return session.tokens + codec.encode(full[len(seen) :])
    # the template rewrote earlier turns (e.g. trimmed a reply): start from the transcript; the
    # cache still serves whatever prefix is unchanged
    return codec.encode_chat(messages)


@dataclass
class PreparedTurn:
    prompt_ids: list[int]
    params: SamplingParams
    session: Session | None = None
    user_text: str | None = None
    _saved: tuple[str | None, list[Message], list[int]] | None = field(default=None, repr=False)
    own_from: int = 0  # where this turn's own text starts: after the history or system prompt
    after_history: bool = False  # own_from ends the session's history
    system: str | None = None  # the conversation's system prompt, as the prompt holds it
    # an interrupted reply joins the session's history (as the REPL keeps one); False: it does
    # not (a batch line cut short, which --resume runs again on the history it had)
    keep_interrupted: bool = True

    def system_tokens(self, codec: ChatCodec) -> list[int]:
        """The leading prompt tokens this turn's system prompt decides (`system_prefix`): what
        `--pin-system` and a request's `pin: "system"` pin. Raises TurnError when the template
        puts nothing there."""
        return system_tokens(codec, self.system, self.prompt_ids)

    def request(self, namespace: str = "") -> Request:
        """The engine request of this turn, cached in `namespace`."""
        sid = self.session.name if self.session is not None else None
        return Request(self.prompt_ids, self.params, sid=sid, namespace=namespace,
                       own_from=self.own_from, after_history=self.after_history)

    def commit(self, result: GenerationResult) -> Turn | None:
        """Record the turn in its session (an interrupted reply too: its K/V is cached, so the
        next turn extends exactly what the model saw)."""
        if self.session is None or self.user_text is None:
            return None
        return record_turn(self.session, self.user_text, self.prompt_ids, result)

    def abort(self) -> None:
        """The turn never ran: the session is as it was before `prepare_turn`."""
        if self.session is not None and self._saved is not None:
            system, messages, tokens = self._saved
            self.session.system = system
            self.session.messages[:] = messages
            self.session.tokens[:] = tokens


def prepare_turn(
    codec: ChatCodec,
    messages: Sequence[Message],
    params: SamplingParams,
    session: Session | None = None,
    system: str | None = None,
) -> PreparedTurn:
    """Template and tokenise a turn. Without a session, `messages` is the whole conversation
    (`system` is put first unless it has a system message). In a session, the last message is
    the new user message; earlier ones (and `system`) may only start a new session."""
    if session is None:
        msgs = [dict(m) for m in messages]
        if system is not None and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": system})
        prompt_ids = codec.encode_chat(msgs)
        own = _head_length(codec, msgs[:-1], prompt_ids) if msgs[-1]["role"] == "user" else 0
        first = next((m["content"] for m in msgs if m["role"] == "system"), None)
        return PreparedTurn(prompt_ids, _stopping(params, codec.turn_stops(msgs)), own_from=own,
                            system=first)
    if not messages or messages[-1]["role"] != "user":
        raise TurnError("the last message of a session turn must be the user's")
    *earlier, last = messages
    saved = (session.system, list(session.messages), list(session.tokens))
    if earlier:
        if session.messages or session.tokens:
            raise TurnError("a later turn of a session gives only its new user message")
        session.system = next((m["content"] for m in earlier if m["role"] == "system"), None)
        session.messages = [dict(m) for m in earlier if m["role"] != "system"]
    if system is not None:
        session.system = system
    if not session.tokens and session.messages:
        # history given as text: template it once, later turns extend its tokens
        text = codec.render_chat(conversation(session), add_generation_prompt=False)
        session.tokens = codec.encode(text)
    prompt = next_prompt(codec, session, last["content"])
    history = bool(session.tokens) and prompt[: len(session.tokens)] == session.tokens
    # the reply's last token was sampled, never fed to the model: this turn computes its K/V
    own = len(session.tokens) - 1 if history else _head_length(codec, conversation(session),
                                                               prompt)
    stops = codec.turn_stops(conversation(session), session=True)
    return PreparedTurn(prompt, _stopping(params, stops), session, last["content"], saved,
                        own_from=own, after_history=history, system=session.system)


class SessionSaver(Protocol):
    """Where a session turn's transcript is written (a `SessionStore`)."""

    def save(self, session: Session) -> None: ...


class TurnOutcome(NamedTuple):
    """How a turn ended, once `finish` has settled it. `result` None: it did not run (`error`
    says why; None when the engine gave no reason) and the session is as it was before
    `prepare_turn`. Otherwise `turn` is what the session recorded (None without a session, or
    for a turn `finish` kept out of it) and `save_error` why its file could not be written (the
    reply still stands)."""

    result: GenerationResult | None
    error: Exception | None = None
    turn: Turn | None = None
    save_error: str | None = None


def finish(prepared: PreparedTurn, event: Finished, sessions: SessionSaver | None = None,
           pin: Callable[[GenerationResult], None] | None = None) -> TurnOutcome:
    """The end of a turn, the same for chat, batch and the server: a result commits to the
    session's history (an interrupted one too, unless the turn says `keep_interrupted` False:
    a batch line cut short runs again on --resume, from the history it had), which `sessions` saves,
    then `pin` runs with it (the request's tokens are stored by now, so the prefix is in the
    cache); a failure or a request that never started aborts the turn. `sessions` None: the
    caller saves the session itself (the REPL saves after each turn and reports a failed save
    in its own words)."""
    result = event.result
    if result is None or event.error is not None:
        prepared.abort()
        return TurnOutcome(None, event.error)
    if not prepared.keep_interrupted and result.finish_reason == "interrupted":
        prepared.abort()  # the reply stands; the session is as it was
        turn = None
    else:
        turn = prepared.commit(result)
    save_error = None
    if turn is not None and sessions is not None and prepared.session is not None:
        try:
            sessions.save(prepared.session)
        except (OSError, KvchatError) as exc:  # the reply still stands; only its transcript not
            save_error = str(exc)
    if pin is not None:
        pin(result)
    return TurnOutcome(result, None, turn, save_error)


def refused(prepared: PreparedTurn, error: Exception) -> TurnOutcome:
    """A turn the engine would not take (`Engine.submit` raised): aborted, as a failure."""
    return finish(prepared, Finished(None, error))


def _stopping(params: SamplingParams, stops: tuple[str, ...]) -> SamplingParams:
    """`params` that also stop at `stops` (the plain-text format's next "User:" line)."""
    extra = tuple(s for s in stops if s not in params.stop)
    return replace(params, stop=params.stop + extra) if extra else params


def record_turn(
    session: Session, user_text: str, prompt_ids: list[int], result: GenerationResult
) -> Turn:
    before = session.tokens
    extends = prompt_ids[: len(before)] == before
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
        start_tokens=len(before) if extends else -1,
    )
    session.turns.append(turn)
    return turn


_PROBE = "kvchat-probe-5f0c2a"  # stands in for the first user message when finding the prefix


def system_prefix(codec: ChatCodec, messages: Sequence[Message], prompt_ids: Sequence[int]
                  ) -> list[int]:
    """The leading tokens of `prompt_ids` that the conversation's system prompt decides: the
    chat template's text before the first user message's content (the system message, or the
    template's default one, and the user header), as tokenised in the prompt. What `/pin` and
    `--pin-system` pin. Raises TurnError when the template puts nothing there."""
    system = [dict(m) for m in messages if m["role"] == "system"][:1]
    n = _head_length(codec, system, prompt_ids)
    if not n:
        raise TurnError("this conversation has no system prompt to pin (try /pin all)")
    return list(prompt_ids[:n])


def system_tokens(codec: ChatCodec, system: str | None, prompt_ids: Sequence[int]
                  ) -> list[int]:
    """`system_prefix` of a conversation whose system prompt is `system` (None: none, so the
    template's default one and the user header, if it has them)."""
    return system_prefix(codec, [{"role": "system", "content": system}] if system else [],
                         prompt_ids)


def _head_length(codec: ChatCodec, earlier: Sequence[Message], prompt_ids: Sequence[int]
                 ) -> int:
    """How many leading tokens of `prompt_ids` come before the content of a user message that
    follows `earlier`: the template's text for the earlier messages (a system prompt, turns)
    and the user header, which other requests may share. 0 when the template puts nothing
    there, or cannot render it."""
    try:
        text = codec.render_chat([*earlier, {"role": "user", "content": _PROBE}],
                                 add_generation_prompt=False)
    except KvchatError:
        return 0
    head = text[: text.find(_PROBE)] if _PROBE in text else ""
    return common_prefix(codec.encode(head), list(prompt_ids)) if head else 0
