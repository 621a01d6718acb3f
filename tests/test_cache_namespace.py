"""Cache namespaces: one pool, but entries stored in one namespace are never a hit in another
(the radix tree keeps one root per namespace, the exact index keys on (namespace, tokens)); a
namespace survives eviction bookkeeping, `check_integrity()` and a snapshot round trip, and a
snapshot written before namespaces existed loads into namespace "".

K/V come from `ref_kv` (a function of the token prefix only), so every hit is checked bitwise."""

from __future__ import annotations

import json

import pytest
import torch
from _cache_helpers import assert_hit_correct, make_cache, make_tiered_cache, ref_kv

from kvchat.cache.kvcache import PagedKVCache
from kvchat.cache.lookup import CacheIntegrityError, HitSource, Lookup, StoreResult
from kvchat.cache.radix import RadixTree
from kvchat.cache.tree_index import export_index, import_index
from kvchat.inspect import documents as cv

BS = 4
PROMPT = list(range(10))
LONGER = [*PROMPT, 40, 41, 42]


def put(cache: PagedKVCache, tokens: list[int], namespace: str, skip: int = 0,
        sid: str | None = None, logits: torch.Tensor | None = None) -> StoreResult:
    res = cache.write_kv(tokens, ref_kv(tokens, skip), skip, logits=logits, sid=sid,
                      namespace=namespace)
    cache.check_integrity()
    return res


def look(cache: PagedKVCache, tokens: list[int], namespace: str) -> Lookup:
    hit = cache.lookup(tokens, namespace=namespace)
    cache.check_integrity()
    assert_hit_correct(cache, hit, tokens)
    cache.release(hit.blocks)
    cache.check_integrity()
    return hit


def test_a_prompt_cached_in_one_namespace_is_a_miss_in_every_other() -> None:
    cache = make_cache(num_blocks=16, block_size=BS)
    put(cache, PROMPT, "alice", logits=torch.ones(3))
    assert look(cache, PROMPT, "alice").source is HitSource.EXACT
    assert look(cache, [*PROMPT, 7], "alice").matched == 10
    for other in ("bob", ""):
        hit = look(cache, [*PROMPT, 7], other)
        assert (hit.matched, hit.source) == (0, HitSource.MISS)
        assert look(cache, PROMPT, other).source is HitSource.MISS
        assert cache.peek(PROMPT, other) == 0
    assert cache.peek(PROMPT, "alice") == 10
    assert not cache.exact.has(PROMPT) and cache.exact.has(PROMPT, "alice")
    assert tuple(PROMPT) not in cache.exact  # `in` asks about namespace ""


def test_the_same_tokens_in_two_namespaces_use_separate_blocks() -> None:
    cache = make_cache(num_blocks=16, block_size=BS)
    a = put(cache, PROMPT, "alice")
    b = put(cache, PROMPT, "bob")
    assert (a.new_tokens, b.new_tokens) == (10, 10)  # bob computed and stored his own
    assert not {x.block_id for x in a.blocks} & {x.block_id for x in b.blocks}
    assert cache.manager.num_blocks - cache.manager.num_free == 6
    assert set(cache.tree.roots) == {"", "alice", "bob"}
    assert {node.namespace for node, _ in cache.tree.nodes()} == {"alice", "bob"}
    # a namespace extends and branches on its own path only
    hit = cache.lookup(LONGER, namespace="bob")
    res = put(cache, LONGER, "bob", skip=hit.matched)
    cache.release(hit.blocks)
    assert (hit.matched, res.new_tokens) == (10, 3)
    assert look(cache, [*LONGER, 0], "bob").matched == 13
    assert look(cache, [*LONGER, 0], "alice").matched == 10
    assert cache.stats().tree_tokens == 23


def test_eviction_empties_a_namespace_and_its_root_goes() -> None:
    cache = make_cache(num_blocks=6, block_size=BS)
    put(cache, PROMPT, "alice", logits=torch.ones(3))
    put(cache, [*range(50, 60)], "")
    assert cache.evict(3) == 3  # alice's blocks are the oldest
    cache.check_integrity()
    assert set(cache.tree.roots) == {""} and len(cache.exact) == 0
    assert look(cache, PROMPT, "alice").matched == 0
    assert cache.peek([*range(50, 60)]) == 10
    put(cache, PROMPT, "alice")  # and it comes back when stored again
    assert set(cache.tree.roots) == {"", "alice"}
    assert cache.clear() == 6
    cache.check_integrity()
    assert set(cache.tree.roots) == {""}


def test_a_full_pool_evicts_across_namespaces_to_store() -> None:
    cache = make_cache(num_blocks=6, block_size=BS)
    put(cache, PROMPT, "alice")
    put(cache, [*range(50, 60)], "bob")
    res = put(cache, [*range(70, 78)], "carol")
    assert res.complete and res.evicted == 2
    assert cache.peek(PROMPT, "alice") == 4 and cache.peek([*range(70, 78)], "carol") == 8


def test_check_integrity_catches_namespace_mixups() -> None:
    cache = make_cache(num_blocks=16, block_size=BS)
    put(cache, PROMPT, "alice", logits=torch.ones(3))
    put(cache, [*range(50, 55)], "bob")
    (node,) = cache.tree.roots["bob"].child_list()
    node.namespace = "alice"
    with pytest.raises(CacheIntegrityError, match="namespace"):
        cache.check_integrity()
    node.namespace = "bob"
    cache.check_integrity()
    (entry,) = (e for _, e in cache.exact.items())
    entry.namespace = "bob"
    with pytest.raises(CacheIntegrityError, match="namespace"):
        cache.check_integrity()
    entry.namespace = "alice"
    cache.check_integrity()
    cache.tree.roots["carol"] = RadixTree(BS).root  # a root for nothing, filed under a name
    with pytest.raises(CacheIntegrityError):
        cache.check_integrity()


def test_the_index_and_disk_tier_keep_the_namespaces(tmp_path) -> None:
    cache = make_tiered_cache(tmp_path, num_blocks=16, block_size=BS)
    put(cache, PROMPT, "alice", sid="t1/chat", logits=torch.arange(3.0))
    put(cache, PROMPT, "", sid="chat")
    put(cache, [*range(50, 55)], "bob", logits=torch.ones(3))
    meta = json.loads(json.dumps(export_index(cache)))  # as index.json holds it
    fresh = make_tiered_cache(tmp_path, num_blocks=16, block_size=BS)
    import_index(fresh, meta)
    fresh.check_integrity()
    assert fresh.manager.num_free == fresh.manager.num_blocks  # nothing loaded at start-up
    assert [n.tokens for n in cv.walk(cv.nodes_from_cache(fresh))] == [
        n.tokens for n in cv.walk(cv.nodes_from_cache(cache))]
    assert cv.nodes_from_meta(meta) == tuple(
        cv.NodeView(n.start, n.tokens, n.blocks, 0, n.owners, n.children, n.namespace)
        for n in cv.nodes_from_cache(cache))
    hit = look(fresh, PROMPT, "alice")
    assert hit.source is HitSource.DISK and hit.matched == len(PROMPT) - 1
    assert_hit_correct(fresh, hit, PROMPT)
    assert look(fresh, [*range(50, 55)], "").matched == 0
    assert look(fresh, [*range(50, 55)], "bob").source is HitSource.DISK
    fresh.check_integrity()
    for c in (cache, fresh):
        assert c.disk is not None
        c.disk.close()


def test_tenants_never_share_a_block_file(tmp_path) -> None:
    cache = make_tiered_cache(tmp_path, num_blocks=16, block_size=BS)
    put(cache, PROMPT, "alice")
    put(cache, PROMPT, "bob")
    keys = {ns: cache.tree.roots[ns].child_list()[0].keys for ns in ("alice", "bob")}
    assert not set(keys["alice"]) & set(keys["bob"])
    assert cache.disk is not None
    cache.disk.close()


def test_views_filter_one_namespace_and_rename_its_owners() -> None:
    cache = make_cache(num_blocks=16, block_size=BS)
    put(cache, PROMPT, "alice", sid="t1/chat", logits=torch.ones(3))
    put(cache, LONGER, "bob", sid="t2/secret", logits=torch.ones(3))
    nodes, exact = cv.nodes_from_cache(cache), cv.exact_from_cache(cache)

    def own(name: str) -> str | None:
        return name.removeprefix("t1/") if name.startswith("t1/") else None

    mine, mine_exact = cv.in_namespace(nodes, exact, "alice", own)
    assert [n.tokens for n in cv.walk(mine)] == [tuple(PROMPT)]
    assert [n.owners for n in mine] == [("chat",)]
    assert [e.tokens for e in mine_exact] == [tuple(PROMPT)]
    hidden, _ = cv.in_namespace(nodes, exact, "bob", own)
    assert [n.owners for n in hidden] == [()]  # another tenant's session names never show
    assert cv.in_namespace(nodes, exact, "carol") == ((), ())


def test_a_scheduler_wave_waits_only_for_its_own_namespace() -> None:
    from kvchat.engine.scheduler import Scheduler
    from kvchat.engine.sequence import Request, Sequence

    cache: PagedKVCache = make_cache(num_blocks=16, block_size=BS)
    scheduler = Scheduler(4, 512, cache.peek)
    shared = list(range(20))
    seqs = [Sequence(i, Request([*shared, 90 + i], namespace=ns), lambda e: None)
            for i, ns in enumerate(["alice", "alice", "bob"])]
    for s in seqs:
        scheduler.add(s)
    plan = scheduler.schedule(0)
    # alice's second request waits for the first's prefix; bob would not hit it anyway
    assert [s.seq_id for s in plan.admit] == [0, 2]
