"""Turning a request body into an engine request: the chat template, sampling defaults, and a
session's next prompt plus the turn to record once the reply is in. Runs in a worker thread
(templating and tokenising), never on the event loop or the engine thread."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import NamedTuple

from kvchat.config import SamplingParams
from kvchat.engine.backend import Backend, GenerationResult
from kvchat.engine.backend import Request as EngineRequest
from kvchat.errors import KvchatError
from kvchat.server.errors import ApiError
from kvchat.server.schemas import ChatCompletionBody, GenerateBody
from kvchat.sessions import Session, SessionStore
from kvchat.turns import next_prompt, record_turn

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
# The OpenAI API maps "developer" onto what chat templates call "system".
_OPENAI_ROLES = {"developer": "system"}


@dataclass
class PendingTurn:
    """A session turn to record once its request finishes."""

    session: Session
    user_text: str
    store: SessionStore

    def record(self, prompt_ids: list[int], result: GenerationResult) -> None:
        # As in the REPL, an interrupted reply is recorded too: its K/V is cached, so the next
        # turn extends exactly what the model saw.
        record_turn(self.session, self.user_text, prompt_ids, result)
        try:
            self.store.save(self.session)
        except OSError:
            log.exception("Could not save session %s.", self.session.name)


class Prepared(NamedTuple):
    """A request and the session turn it makes, if any."""

    request: EngineRequest
    turn: PendingTurn | None = None


class Sessions:
    """Sessions served so far, loaded once from the sessions dir. Turns of one session run one
    after another, in arrival order (an asyncio lock per session, held until the turn is
    recorded)."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._open: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.turn_locks: dict[str, asyncio.Lock] = {}

    def get(self, name: str, create: bool) -> Session:
        with self._lock:
            session = self._open.get(name)
            if session is None:
                if self.store.exists(name):
                    session = self.store.load(name)
                elif create:
                    session = Session(name)
                    self.store.save(session)
                else:
                    raise ApiError(
                        404, "session_not_found",
                        f"No session {name!r}. Send \"create_session\": true to start it.",
                    )
                self._open[name] = session
            return session


def stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(s for s in stop if s)


class Preparer:
    """Builds engine requests from the two API families' bodies."""

    def __init__(self, backend: Backend, sessions: Sessions,
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.backend = backend
        self.sessions = sessions
        self.max_tokens = max_tokens

    def params(self, max_new: int | None, temperature: float | None, default_temperature: float,
               top_p: float | None, top_k: int | None, seed: int | None,
               stop: str | list[str] | None) -> SamplingParams:
        wanted = max_new if max_new is not None else self.max_tokens
        max_context = self.backend.max_context
        if wanted > max_context:
            raise ApiError(400, "invalid_request_error",
                           f"max_tokens must be at most the model's context "
                           f"({max_context:,}), got {wanted:,}.")
        return SamplingParams(
            max_new_tokens=wanted,
            temperature=default_temperature if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=top_k or 0,
            seed=seed,
            stop=stops(stop),
        )

    def generate(self, body: GenerateBody) -> Prepared:
        """POST /generate: a prompt or messages (greedy by default), or a session's next turn."""
        p = self.params(body.max_tokens, body.temperature, 0.0, body.top_p, body.top_k,
                        body.seed, body.stop)
        backend = self.backend
        if body.session is None:
            messages = ([m.model_dump() for m in body.messages] if body.messages is not None
                        else [{"role": "user", "content": body.prompt or ""}])
            if body.system is not None and not any(m["role"] == "system" for m in messages):
                messages.insert(0, {"role": "system", "content": body.system})
            request = EngineRequest(backend.encode_chat(messages), p)
            backend.check_request(request)
            return Prepared(request)
        session = self.sessions.get(body.session, body.create_session)
        user_text = body.prompt or ""
        system = session.system
        if body.system is not None:
            session.system = body.system
        request = EngineRequest(next_prompt(backend, session, user_text), p, sid=session.name)
        try:
            backend.check_request(request)
        except KvchatError:
            session.system = system  # the turn never happens: nothing changes
            raise
        return Prepared(request, PendingTurn(session, user_text, self.sessions.store))

    def chat(self, body: ChatCompletionBody) -> Prepared:
        """POST /v1/chat/completions: OpenAI's default temperature is 1."""
        p = self.params(body.max_completion_tokens or body.max_tokens, body.temperature, 1.0,
                        body.top_p, None, body.seed, body.stop)
        messages = [{"role": _OPENAI_ROLES.get(m.role, m.role), "content": m.text()}
                    for m in body.messages]
        request = EngineRequest(self.backend.encode_chat(messages), p)
        self.backend.check_request(request)
        return Prepared(request)
