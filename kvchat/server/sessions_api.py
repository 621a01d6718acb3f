"""Sessions over HTTP, for clients attached to a resident server (`kvchat chat`): list them,
read one, write one (its system prompt, or a history rewound or forked by the client), and
save the cache snapshot now. Each caller sees only its own sessions (the admin: the sessions
dir's; a tenant: its own folder)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Body
from starlette.concurrency import run_in_threadpool

from kvchat.server.auth import Caller
from kvchat.server.errors import ApiError, api_error
from kvchat.server.prepare import Sessions
from kvchat.server.state import State
from kvchat.sessions import Session, SessionError, validate_name

router = APIRouter()


def session_name(name: str) -> str:
    """A session name from a path, checked (a 400 naming the rule otherwise)."""
    try:
        return validate_name(name)
    except SessionError as exc:
        raise api_error(exc) from exc


def _listing(sessions: Sessions) -> list[dict[str, Any]]:
    rows = []
    for name in sessions.store.names():
        try:
            s = sessions.get(name, create=False)
        except (SessionError, ApiError):
            continue  # an unreadable file was set aside
        rows.append({"name": name, "turns": len(s.turns), "updated": s.updated})
    return rows


@router.get("/sessions")
async def list_sessions(state: State, tenant: Caller) -> dict[str, Any]:
    """The caller's saved sessions: name, number of turns, last update."""
    sessions = state.sessions.of(tenant)
    return {"sessions": await run_in_threadpool(_listing, sessions)}


@router.get("/sessions/{name}")
async def get_session(name: str, state: State, tenant: Caller) -> dict[str, Any]:
    """One session as its file holds it (a 404 when there is none), once a turn of it in
    flight is recorded: a client that hung up on a reply reads the turn it stopped (unless it
    sent "keep_interrupted": false)."""
    sessions = state.sessions.of(tenant)
    name = session_name(name)
    async with sessions.turn_locks.setdefault(name, asyncio.Lock()):
        try:
            session = await run_in_threadpool(sessions.get, name, False)
        except SessionError as exc:
            raise api_error(exc) from exc
        return session.to_json()


@router.put("/sessions/{name}")
async def put_session(name: str, state: State, tenant: Caller,
                      doc: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    """Write a session: its system prompt, messages, tokens and turns. Waits for a turn of
    that session in flight, so a turn's record is never lost to a write."""
    sessions = state.sessions.of(tenant)
    name = session_name(name)
    try:
        new = Session.from_json({**doc, "name": name})
    except (KeyError, TypeError, ValueError) as exc:
        raise ApiError(400, "invalid_request_error", f"Not a session document: {exc}.") from exc
    vocab = state.worker.codec.vocab_size
    if any(t >= vocab for t in new.tokens):
        raise ApiError(400, "invalid_request_error", "Not a session document: its tokens hold "
                       f"ids past this model's vocabulary ({vocab:,} ids).")
    lock = sessions.turn_locks.setdefault(name, asyncio.Lock())
    async with lock:
        def write() -> Session:
            session = sessions.get(name, create=True)
            session.system, session.messages = new.system, new.messages
            session.tokens, session.turns = new.tokens, new.turns
            sessions.store.save(session)
            return session

        try:
            session = await run_in_threadpool(write)
        except SessionError as exc:
            raise api_error(exc) from exc
    return session.to_json()


@router.post("/cache/save")
async def save_snapshot(state: State, tenant: Caller) -> dict[str, Any]:
    """Write the cache snapshot now (the admin only: it is the whole cache)."""
    if not tenant.admin:
        raise ApiError(403, "forbidden", "Only the admin token may save the cache snapshot.")
    worker = state.worker

    def save() -> dict[str, Any]:
        path = worker.runtime.save()
        return {"path": str(path) if path else None,
                "tokens": worker.runtime.cache.stats().tree_tokens}

    return await state.on_engine(lambda: worker.call(save))
