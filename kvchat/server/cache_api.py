"""The live cache: GET /cache/stats (counters and occupancy) and GET /cache/tree (the schema of
`kvchat inspect --json`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool

from kvchat.server.errors import api_error
from kvchat.server.state import State
from kvchat.server.worker import CacheTree, EngineWorker
from kvchat.sessions import SessionError, validate_name
from kvchat.ui import cache_view as cv

router = APIRouter()


@router.get("/cache/stats")
async def cache_stats(state: State) -> dict[str, Any]:
    """Hit and miss counts and rates, hit tokens, evictions, pool occupancy, policy,
    per-session counters, and the server's own request counters."""
    return await state.on_engine(state.worker.stats)


@router.get("/cache/tree")
async def cache_tree(
    state: State,
    depth: int | None = Query(None, ge=1),
    session: str | None = Query(None),
) -> dict[str, Any]:
    """The live cache in the schema of `kvchat inspect --json`."""
    if session is not None:
        try:
            validate_name(session)
        except SessionError as exc:
            raise api_error(exc) from exc
    tree = await state.on_engine(state.worker.tree)
    # decoding previews is tokenizer work: off the event loop, and off the engine thread
    return await run_in_threadpool(tree_json, state.worker, tree, session, depth)


def tree_json(worker: EngineWorker, tree: CacheTree, session: str | None,
              depth: int | None) -> dict[str, Any]:
    codec = worker.codec

    def decode(tokens: Any) -> str:
        return codec.decode(list(tokens), skip_special_tokens=False)

    return cv.inspect_document(worker.info.fingerprint, worker.snapshot_info(), tree.stats,
                               tree.nodes, tree.exact, decode, depth, session)
