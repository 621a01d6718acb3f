"""Turning a request body into a turn (`kvchat.turns`): sampling defaults per API family, the
session it continues, and the checks a client should hear about before a stream starts. Runs in
a worker thread (templating and tokenising), never on the event loop or the engine thread."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable
from pathlib import Path

from kvchat.config import SamplingParams, merge_params
from kvchat.engine.engine import Engine
from kvchat.errors import KvchatError
from kvchat.server.auth import TENANTS_DIR, Tenant
from kvchat.server.errors import ApiError
from kvchat.server.schemas import ChatCompletionBody, CompletionBody, GenerateBody
from kvchat.sessions import Session, SessionNotFound, SessionStore, private_dir
from kvchat.turns import PreparedTurn, prepare_turn, refused

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
NO_CHAT_TEMPLATE = ("This model has no chat template, so its messages cannot be written as a "
                    "prompt. Send a plain prompt to /v1/completions (or /generate), or start "
                    "kvchat serve with --chat-template FILE|NAME.")
# Normalizers may shorten text before it is split: bound tokens from half the characters.
_NORMALIZE_MARGIN = 2
# The OpenAI API maps "developer" onto what chat templates call "system".
_OPENAI_ROLES = {"developer": "system"}


class Sessions:
    """A tenant's sessions as the server serves them: its `SessionStore` is their one registry
    (the same Session object for a name, whoever opens it); this adds what HTTP needs. Turns of
    one session run one after another, in arrival order (an asyncio lock per session, held
    until the turn is recorded)."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._lock = threading.Lock()  # a session is created (and its file written) once
        self.turn_locks: dict[str, asyncio.Lock] = {}

    def get(self, name: str, create: bool) -> Session:
        with self._lock:
            new = not self.store.exists(name)
            try:
                session = self.store.open(name, create)
            except SessionNotFound:
                raise ApiError(
                    404, "session_not_found",
                    f"No session {name!r}. Send \"create_session\": true to start it.",
                ) from None
            if new:
                self.store.save(session)
            return session


class TenantSessions:
    """Each tenant's own Sessions: the admin's are the sessions dir's own files; an API key's
    tenant has sessions/tenants/<tenant id>/ (0700; session files are 0600), so no tenant can
    name, read or continue another's session (it is unknown there: a 404)."""

    def __init__(self, admin: SessionStore) -> None:
        self.admin = Sessions(admin)
        self._tenants: dict[str, Sessions] = {}
        self._lock = threading.Lock()

    def of(self, tenant: Tenant) -> Sessions:
        if tenant.admin:
            return self.admin
        with self._lock:
            sessions = self._tenants.get(tenant.id)
            if sessions is None:
                root = private_dir(Path(self.admin.store.root))
                folder = private_dir(private_dir(root / TENANTS_DIR) / tenant.id)
                sessions = self._tenants[tenant.id] = Sessions(SessionStore(folder))
            return sessions


class Preparer:
    """Builds turns from the two API families' bodies."""

    def __init__(self, engine: Engine, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.engine = engine
        self.max_tokens = max_tokens

    def params(self, max_new: int | None, temperature: float | None, default_temperature: float,
               top_p: float | None, top_k: int | None, seed: int | None,
               stop: str | list[str] | None) -> SamplingParams:
        wanted = max_new if max_new is not None else self.max_tokens
        max_context = self.engine.max_context
        if wanted > max_context:
            raise ApiError(400, "invalid_request_error",
                           f"max_tokens must be at most the model's context "
                           f"({max_context:,}), got {wanted:,}.")
        defaults = SamplingParams(max_new_tokens=self.max_tokens, temperature=default_temperature)
        return merge_params(defaults, max_new, temperature, top_p, top_k, seed, stop)

    def check_size(self, texts: Iterable[str]) -> None:
        """Refuse, before any tokenising, text that cannot fit the model's context: c characters
        are at least c / (2 x the longest token) tokens. So no request tokenises more than
        about context x longest token x 2 characters, whatever size of body it sends."""
        chars = sum(len(t) for t in texts)
        per_token = self.engine.codec.longest_token * _NORMALIZE_MARGIN
        at_least, context = chars // per_token, self.engine.max_context
        if at_least >= context:
            raise ApiError(400, "context_length_exceeded",
                           f"The prompt is {chars:,} characters long, so at least "
                           f"{at_least:,} tokens; the model's context is {context:,} tokens. "
                           "It was refused without being tokenised.")

    def _checked(self, turn: PreparedTurn) -> PreparedTurn:
        try:
            self.engine.check_request(turn.request())
        except KvchatError as exc:
            refused(turn, exc)  # the turn never happens: nothing changes
            raise
        return turn

    def generate(self, body: GenerateBody, sessions: Sessions) -> PreparedTurn:
        """POST /generate: a prompt or messages (greedy by default), or a session's next turn
        (of the caller's `sessions`)."""
        p = self.params(body.max_tokens, body.temperature, 0.0, body.top_p, body.top_k,
                        body.seed, body.stop)
        messages = ([m.model_dump() for m in body.messages] if body.messages is not None
                    else [{"role": "user", "content": body.prompt or ""}])
        self.check_size([*(m["content"] for m in messages), body.system or ""])
        session = None
        if body.session is not None:
            session = sessions.get(body.session, body.create_session)
        turn = self._checked(prepare_turn(self.engine.codec, messages, p, session, body.system))
        turn.keep_interrupted = body.keep_interrupted
        return turn

    def chat(self, body: ChatCompletionBody) -> PreparedTurn:
        """POST /v1/chat/completions: OpenAI's default temperature is 1. A model without a
        chat template cannot have messages written as a prompt (vLLM refuses it too)."""
        if not self.engine.codec.has_template:
            raise ApiError(400, "invalid_request_error", NO_CHAT_TEMPLATE)
        p = self.params(body.max_completion_tokens or body.max_tokens, body.temperature, 1.0,
                        body.top_p, None, body.seed, body.stop)
        messages = [{"role": _OPENAI_ROLES.get(m.role, m.role), "content": m.text()}
                    for m in body.messages]
        self.check_size(m["content"] for m in messages)
        return self._checked(prepare_turn(self.engine.codec, messages, p))

    def completion(self, body: CompletionBody) -> PreparedTurn:
        """POST /v1/completions: the prompt as it is (after the tokenizer's BOS, as the
        tokenizer adds it), or its token ids; OpenAI's default temperature is 1."""
        p = self.params(body.max_tokens, body.temperature, 1.0, body.top_p, None, body.seed,
                        body.stop)
        prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(
            body.prompt[0], str) else body.prompt
        if isinstance(prompt, str):
            ids = self.engine.codec.encode_prompt(prompt)
        else:
            vocab = len(self.engine.codec.tokenizer)
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, "invalid_request_error",
                               f"prompt token ids must be in [0, {vocab:,}).")
            ids = [int(t) for t in prompt]
        return self._checked(PreparedTurn(ids, p))
