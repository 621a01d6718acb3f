"""Conversation moves over HTTP, as `kvchat chat`'s /retry, /rewind, /fork and /branches do
them (`kvchat.chat.moves`): POST /sessions/{name}/rewind, /fork and /retry, and
GET /sessions/{name}/branches.

The radix tree already holds every earlier state of a conversation, so these are nearly free:
a rewound session continues from a cached prefix, a fork reads its history from the same blocks
(nothing is copied), and a retried prompt is an exact hit. Each caller moves only its own
sessions; every move waits for a turn of the session in flight (its turn lock).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from starlette.concurrency import run_in_threadpool

from kvchat.server import native
from kvchat.server.auth import Caller
from kvchat.server.errors import ApiError, api_error
from kvchat.server.prepare import Sessions
from kvchat.server.schemas import ForkBody, GenerateBody, RetryBody, RewindBody
from kvchat.server.sessions_api import session_name
from kvchat.server.state import State
from kvchat.sessions import Session, SessionError, branches

router = APIRouter()


async def _open(sessions: Sessions, name: str) -> Session:
    """The caller's session `name` (a 404 when it has none)."""
    try:
        return await run_in_threadpool(sessions.get, name, False)
    except SessionError as exc:
        raise api_error(exc) from exc


def _lock(sessions: Sessions, name: str) -> asyncio.Lock:
    return sessions.turn_locks.setdefault(name, asyncio.Lock())


def _no_turns(name: str, move: str) -> ApiError:
    return ApiError(409, "no_turns", f"Session {name!r} has no turns yet: nothing to {move}.")


@router.post("/sessions/{name}/rewind")
async def rewind(name: str, state: State, tenant: Caller,
                 body: Annotated[RewindBody | None, Body()] = None) -> dict[str, Any]:
    """Drop the last `turns` turns (default 1). What is left is a prefix of what the model
    saw, so the next turn is a cache hit for all of it."""
    sessions = state.sessions.of(tenant)
    name = session_name(name)
    n = body.turns if body is not None else 1
    async with _lock(sessions, name):
        session = await _open(sessions, name)
        if not session.turns:
            raise _no_turns(name, "rewind")
        gone = session.rewind(n)
        await run_in_threadpool(sessions.store.save, session)
        return {"session": name, "rewound": gone, "turns": len(session.turns),
                "tokens": len(session.tokens)}


@router.post("/sessions/{name}/fork", status_code=201)
async def fork(name: str, body: ForkBody, state: State, tenant: Caller) -> dict[str, Any]:
    """A new session `body.name` with this one's history (409 if that name is taken). Both
    read the history from the same cached blocks."""
    sessions = state.sessions.of(tenant)
    name = session_name(name)
    if body.name == name:
        raise ApiError(409, "session_exists", f"{name!r} is the session being forked; fork "
                       "under another name.")
    first, second = sorted((name, body.name))  # one order, so two forks never deadlock
    async with _lock(sessions, first), _lock(sessions, second):
        session = await _open(sessions, name)

        def write() -> Session:
            if sessions.store.exists(body.name):
                raise ApiError(409, "session_exists", f"A session {body.name!r} exists "
                               "already; fork under another name.")
            sessions.store.save(session.fork(body.name))
            return sessions.get(body.name, create=False)

        try:
            new = await run_in_threadpool(write)
        except SessionError as exc:
            raise api_error(exc) from exc
        return {"session": new.name, "from": name, "turns": len(new.turns),
                "tokens": len(new.tokens)}


def _others(sessions: Sessions, name: str) -> list[Session]:
    out = []
    for other in sessions.store.names():
        if other == name:
            continue
        try:
            out.append(sessions.get(other, create=False))
        except (SessionError, ApiError):
            continue  # an unreadable file was set aside
    return out


@router.get("/sessions/{name}/branches")
async def list_branches(name: str, state: State, tenant: Caller) -> dict[str, Any]:
    """The caller's other sessions whose history starts like this one's, most shared first:
    for how many tokens, and how many turns each has."""
    sessions = state.sessions.of(tenant)
    name = session_name(name)
    session = await _open(sessions, name)
    others = await run_in_threadpool(_others, sessions, name)
    rows = branches(session, others)
    return {"session": name, "tokens": len(session.tokens),
            "branches": [{"name": b.name, "shared_tokens": b.shared, "turns": b.turns}
                         for b in rows]}


@router.post("/sessions/{name}/retry", response_model=None)
async def retry(name: str, request: Request, state: State, tenant: Caller,
                body: Annotated[RetryBody | None, Body()] = None) -> Any:
    """Regenerate the last reply: the last turn is rewound and its user message sent again
    (its prompt is then an exact hit). Greedy by default, so the reply is the same; sampling
    options as /generate's. The reply is /generate's; if the retry does not run, the old turn
    stays."""
    sessions = state.sessions.of(tenant)
    name = session_name(name)
    options = body.model_dump(exclude_none=True) if body is not None else {}
    lock = _lock(sessions, name)
    await lock.acquire()
    try:
        session = await _open(sessions, name)
        if not session.turns:
            raise _no_turns(name, "retry")
        text = session.messages[-2]["content"]
        saved = session.fork(session.name)
        session.rewind(1)
    except BaseException:
        lock.release()
        raise

    def undo() -> None:  # the retry did not run: the old turn is back, as the file has it
        session.messages[:], session.tokens[:] = saved.messages, saved.tokens
        session.turns[:] = saved.turns

    generate = GenerateBody.model_validate({**options, "prompt": text, "session": name})
    return await native.reply(generate, request, state, tenant, lock, undo)
