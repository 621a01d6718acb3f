"""Pinned prefixes over HTTP: POST /cache/pin, GET /cache/pins, DELETE /cache/pin, and the
`pin` option of /generate and /v1/chat/completions (`pin_job`).

A pin keeps a cached prefix's blocks in the pool however hard eviction presses (a system prompt
every conversation starts with), up to --max-pinned of the pool. Each caller pins in its own
namespace and sees only its own pins (`kvchat.server.pinning`).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Query
from starlette.concurrency import run_in_threadpool

from kvchat.cache.pins import Pin, PinError
from kvchat.config import SamplingParams
from kvchat.server.auth import Caller, Tenant
from kvchat.server.errors import ApiError, api_error
from kvchat.server.pinning import (
    LABELS,
    PinJob,
    Pinner,
    pin_json,
    pin_message,
    pin_what,
)
from kvchat.server.prepare import Sessions
from kvchat.server.schemas import PinBody, PinOption, UnpinBody
from kvchat.server.state import ServerState, State
from kvchat.turns import prepare_turn, system_tokens

router = APIRouter()


def pinner(state: ServerState) -> Pinner:
    """The cache's pins as tenants own them; use it on the engine thread only."""
    return Pinner(state.worker.runtime.cache, state.pin_owners)


def pin_job(state: ServerState, option: PinOption, tenant: Tenant, namespace: str
            ) -> PinJob | None:
    """What a request's `pin` option asks for (None: nothing)."""
    what = pin_what(option)
    if what is None:
        return None
    return PinJob(what, pinner(state), tenant, namespace, state.worker.codec)


def pin_tokens(state: ServerState, sessions: Sessions, body: PinBody) -> list[int]:
    """The tokens `body` names (worker thread: templating and tokenising): a prompt as a
    request would send it, or a session's history so far; all of them, or the part the system
    prompt decides."""
    codec = state.worker.codec
    if body.session is not None:
        session = sessions.get(body.session, create=False)
        system, tokens = session.system, list(session.tokens)
        if not tokens:
            raise ApiError(409, "not_cached", f"Session {body.session!r} has no turns yet: "
                           "nothing of it is cached to pin.")
    else:
        messages = ([m.model_dump() for m in body.messages] if body.messages is not None
                    else [{"role": "user", "content": body.prompt or ""}])
        state.preparer.check_size([*(m["content"] for m in messages), body.system or ""])
        turn = prepare_turn(codec, messages, SamplingParams(), system=body.system)  # as a request
        system, tokens = turn.system, turn.prompt_ids
    return tokens if body.what == "all" else system_tokens(codec, system, tokens)


@router.post("/cache/pin", status_code=201)
async def pin(body: PinBody, state: State, tenant: Caller) -> dict[str, Any]:
    """Pin a cached prefix in the caller's namespace: 201 with the pin; 409 when it is not
    (all) cached or would pass --max-pinned."""
    namespace = state.gate.namespace(tenant, body.cache_salt)
    sessions = state.sessions.of(tenant)
    try:
        tokens = await run_in_threadpool(pin_tokens, state, sessions, body)
    except Exception as exc:
        raise api_error(exc) from exc
    pins = pinner(state)

    def make() -> Pin:
        pinned = tokens
        if body.session is not None and body.what == "all":
            # a history ends with a reply token whose K/V no forward computed: pin what is
            pinned = tokens[: pins.cache.peek(tokens, namespace)]
        return pins.pin(tenant, pinned, namespace, LABELS[body.what])

    try:
        made = await state.on_engine(lambda: state.worker.call(make))
    except PinError as exc:
        raise ApiError(409, "pin_refused", pin_message(str(exc))) from exc
    return pin_json(made, tenant)


@router.get("/cache/pins")
async def list_pins(state: State, tenant: Caller) -> dict[str, Any]:
    """The caller's pins (the admin: every pin), and the pool's cap on them."""
    pins = pinner(state)

    def read() -> dict[str, Any]:
        table = pins.cache.pins
        doc: dict[str, Any] = {"pins": [pin_json(p, tenant) for p in pins.listing(tenant)]}
        if tenant.admin:  # how full the pinned share is says something of others' pins
            doc.update(pinned_blocks=len(table.block_ids), max_pinned_blocks=table.cap)
        return doc

    return await state.on_engine(lambda: state.worker.call(read))


@router.delete("/cache/pin")
async def unpin(state: State, tenant: Caller,
                pin_id: Annotated[str | None, Query(alias="id")] = None,
                body: Annotated[UnpinBody | None, Body()] = None) -> dict[str, Any]:
    """End one of the caller's pins (`id` in the query or the body): 200 with the pin, 404
    when it has none of that id."""
    wanted = pin_id if pin_id is not None else body.id if body is not None else None
    if wanted is None:
        raise ApiError(400, "invalid_request_error", 'Name the pin to end: "id" in the query '
                       "string or the body (GET /cache/pins lists them).")
    pins = pinner(state)
    gone = await state.on_engine(lambda: state.worker.call(lambda: pins.unpin(tenant, wanted)))
    if gone is None:
        raise ApiError(404, "not_found", f"No pin {wanted!r} (GET /cache/pins lists yours).")
    return pin_json(gone, tenant)
