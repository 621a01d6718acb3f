"""The live cache: GET /cache/stats (counters and occupancy) and GET /cache/tree (the schema of
`kvchat inspect --json`).

The admin sees the whole cache. A tenant sees only its own: the tree and exact entries of its
private namespace (none when it shares one: those entries hold other tenants' prompts), its own
sessions under their own names, and counters of its own requests; never the model's or the
tokenizer's local paths.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool

from kvchat.cache.stats import CacheStats, Counters, PoolStats
from kvchat.cache.visibility import Visibility
from kvchat.inspect import documents as cv
from kvchat.server.auth import Caller, Tenant
from kvchat.server.errors import api_error
from kvchat.server.state import State
from kvchat.server.worker import CacheTree, EngineWorker, TenantCounters
from kvchat.sessions import SessionError, validate_name

router = APIRouter()


@router.get("/cache/stats")
async def cache_stats(state: State, tenant: Caller) -> dict[str, Any]:
    """Hit and miss counts and rates, hit tokens, evictions, pool occupancy, policy,
    per-session counters, and the server's own request counters (a tenant's own, for a
    tenant)."""
    if tenant.admin:
        return await state.on_engine(state.worker.stats)
    tree = await state.on_engine(state.worker.tree)
    view = await run_in_threadpool(visible, tree, tenant)
    doc = view.stats.to_json()
    own = tree.tenants.get(tenant.id, TenantCounters())
    doc["server"] = {"model": state.worker.info.model_id, "requests": own.requests,
                     "completed": own.completed, "cancelled": own.cancelled,
                     "errors": own.errors}
    return doc


@router.get("/cache/tree")
async def cache_tree(
    state: State,
    tenant: Caller,
    depth: int | None = Query(None, ge=1),
    session: str | None = Query(None),
) -> dict[str, Any]:
    """The live cache in the schema of `kvchat inspect --json` (a tenant's part of it)."""
    if session is not None:
        try:
            validate_name(session)
        except SessionError as exc:
            raise api_error(exc) from exc
    tree = await state.on_engine(state.worker.tree)
    # filtering and decoding previews are work: off the event loop, and off the engine thread
    return await run_in_threadpool(tree_json, state.worker, tree, tenant, session, depth)


def visible(tree: CacheTree, tenant: Tenant) -> CacheTree:
    """What `tenant` may see of the cache: all of it for the admin; otherwise its private
    namespace's entries, its own sessions, and stats computed from those and its own
    requests (the pool's size, not its occupancy by others)."""
    if tenant.admin:
        return tree
    # a namespace others write to holds their prompts: no tree, no exact entries of it
    nodes, exact = ((), ()) if tenant.sees(tenant.namespace) is Visibility.OWN else (
        cv.in_namespace(tree.nodes, tree.exact, tenant.namespace, tenant.own))
    own = tree.tenants.get(tenant.id, TenantCounters())
    sessions = {name: c for sid, c in tree.stats.sessions.items()
                if (name := tenant.own(sid)) is not None}
    counters = Counters(
        hit_count=own.hits, miss_count=own.lookups - own.hits, exact_hits=own.exact_hits,
        hit_tokens=own.hit_tokens, lookup_tokens=own.prompt_tokens,
        stored_tokens=own.stored_tokens, sessions=sessions)
    walked = list(cv.walk(nodes))
    pool = tree.stats.pool
    stats = CacheStats.build(
        counters, policy=tree.stats.policy,
        pool=PoolStats(pool.block_size, pool.total_blocks, sum(n.blocks for n in walked),
                       pool.bytes_per_block),
        tree_nodes=len(walked), tree_tokens=sum(n.n_tokens for n in walked),
        exact_entries=len(exact))
    return CacheTree(nodes, exact, stats, {tenant.id: own})


def tree_json(worker: EngineWorker, tree: CacheTree, tenant: Tenant, session: str | None,
              depth: int | None) -> dict[str, Any]:
    codec = worker.codec

    def decode(tokens: Any) -> str:
        return codec.decode(list(tokens), skip_special_tokens=False)

    view = visible(tree, tenant)
    fingerprint, snapshot = dict(worker.info.fingerprint), worker.snapshot_info()
    if not tenant.admin:  # local paths are the operator's business
        fingerprint["model"] = snapshot["model_label"] = worker.info.model_id
        snapshot["path"] = snapshot["tokenizer_file"] = None
    disk = worker.disk_tier() if tenant.admin else None  # the store holds every tenant's
    return cv.inspect_document(fingerprint, snapshot, view.stats, view.nodes, view.exact,
                               decode, depth, session, disk)
