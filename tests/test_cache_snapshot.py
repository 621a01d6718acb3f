"""The cache's state as plain data: the pool exports and imports blocks, the radix tree rebuilds
itself from records, policies save their state, and a snapshot restores the same cache (K/V bit
for bit, tree, exact entries with logits, counters) or, when damaged, leaves it empty."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from _cache_helpers import assert_kv_equal, fetch, make_cache, make_manager, ref_kv, store

from kvchat.cache.eviction import make_policy
from kvchat.cache.kvcache import HitSource, PagedKVCache
from kvchat.cache.radix import RadixTree
from kvchat.cache.snapshot import SnapshotMismatch, export_state, import_state
from kvchat.cache.tree_index import export_blocks, tree_from_blocks
from kvchat.ui import cache_view as cv

BS = 4
A = list(range(10))
B = [*range(6), 50, 51, 52]  # branches off A inside block 1
C = list(range(100, 105))


def filled(policy: str = "lru") -> PagedKVCache:
    cache = make_cache(num_blocks=16, block_size=BS, policy=policy)
    store(cache, A, logits=torch.arange(3.0), sid="a")
    hit = cache.lookup(B, sid="b")
    store(cache, B, skip=hit.matched, sid="b")
    cache.release(hit.blocks)
    store(cache, C, logits=torch.ones(3), logits_len=4, sid="c")
    fetch(cache, A)  # an exact hit
    return cache


def round_trip(cache: PagedKVCache, policy: str = "lru") -> PagedKVCache:
    meta, tensors = export_state(cache)
    meta = json.loads(json.dumps(meta))  # as index.json holds it
    fresh = make_cache(num_blocks=16, block_size=BS, policy=policy)
    import_state(fresh, meta, tensors)
    fresh.check_integrity()
    return fresh


def test_a_snapshot_restores_the_same_cache() -> None:
    cache = filled()
    before = cache.stats()
    fresh = round_trip(cache)
    assert fresh.stats() == before
    assert cv.nodes_from_cache(fresh) == cv.nodes_from_cache(cache)
    assert cv.exact_from_cache(fresh) == cv.exact_from_cache(cache)
    for tokens in (A, B, C):  # K/V bitwise, from the restored blocks
        assert fetch(fresh, [*tokens, -1]).matched == len(tokens)
    hit = fetch(fresh, A)
    assert hit.source is HitSource.EXACT and hit.logits is not None
    assert torch.equal(hit.logits, torch.arange(3.0))
    assert fetch(fresh, C[:4]).source is HitSource.EXACT


def test_the_lru_clock_resumes_after_the_restored_stamps() -> None:
    cache = filled()
    newest = max(b.last_accessed for b in cache.tree.all_blocks())
    fresh = round_trip(cache)
    assert fresh.policy.state() == cache.policy.state() == {"clock": newest}
    hit = fetch(fresh, [*C, 0])
    assert all(b.last_accessed > newest for b in hit.blocks)
    fresh.evict(1)  # B's tail: the oldest leaf block, as it was before the restart
    assert (fresh.peek(A), fresh.peek(B), fresh.peek(C)) == (10, 8, 5)


def test_index_json_keeps_its_keys_and_counts_only() -> None:
    meta, _ = export_state(filled())
    assert set(meta) == {"version", "block_size", "shape", "policy", "policy_state", "blocks",
                         "tree", "exact", "counters"}
    assert set(meta["blocks"][0]) == {"tokens", "last_accessed", "attn_score"}
    assert meta["counters"]["sessions"]["b"] == {"lookups": 1, "hits": 1, "prompt_tokens": 9,
                                                 "hit_tokens": 6}
    assert meta["counters"]["exact_hits"] == 1 and "hit_rate" not in meta["counters"]


def test_an_older_snapshot_without_policy_state_or_new_counters_loads() -> None:
    cache = filled()
    meta, tensors = export_state(cache)
    del meta["policy_state"]
    del meta["counters"]["stored_tokens"]
    fresh = make_cache(num_blocks=16, block_size=BS)
    import_state(fresh, meta, tensors)
    fresh.check_integrity()
    newest = max(b.last_accessed for b in cache.tree.all_blocks())
    assert fresh.policy.state() == {"clock": newest}
    assert fresh.stats().stored_tokens == 0
    assert fresh.stats().hit_count == cache.stats().hit_count


def _damage_dangling(meta: dict[str, Any]) -> None:
    meta["tree"][0]["blocks"].append(99)


def _damage_tokens(meta: dict[str, Any]) -> None:
    meta["blocks"][0]["tokens"] = [7, 7, 7, 7, 7]


def _damage_start(meta: dict[str, Any]) -> None:
    meta["tree"][0]["children"][0]["start"] += 1


@pytest.mark.parametrize("damage", [_damage_dangling, _damage_tokens, _damage_start])
def test_a_damaged_snapshot_is_refused_and_leaves_the_cache_empty(damage: Any) -> None:
    meta, tensors = export_state(filled())
    damage(meta)
    fresh = make_cache(num_blocks=16, block_size=BS)
    with pytest.raises(SnapshotMismatch, match="damaged"):
        import_state(fresh, meta, tensors)
    fresh.check_integrity()
    s = fresh.stats()
    assert (s.pool.used_blocks, s.tree_nodes, s.exact_entries, s.lookup_tokens) == (0, 0, 0, 0)
    store(fresh, A)  # and it works as a cache
    assert fetch(fresh, [*A, 1]).matched == 10


def test_a_snapshot_that_does_not_fit_is_refused() -> None:
    meta, tensors = export_state(filled())
    small = make_cache(num_blocks=3, block_size=BS)
    with pytest.raises(SnapshotMismatch, match="raise --cache-mb"):
        import_state(small, meta, tensors)
    busy = make_cache(num_blocks=16, block_size=BS)
    store(busy, C)
    with pytest.raises(SnapshotMismatch, match="not empty"):
        import_state(busy, meta, tensors)
    busy.check_integrity()


def test_reset_frees_everything_even_held_blocks() -> None:
    cache = filled()
    cache.lookup(A)  # held, never released
    cache.reset()
    cache.check_integrity()
    assert cache.manager.num_free == 16 and cache.stats() == make_cache(16, BS).stats()


# ---- the parts -------------------------------------------------------------------------------


def test_block_manager_exports_and_imports_blocks() -> None:
    src = make_manager(num_blocks=6, block_size=BS)
    blocks = src.allocate(2)
    src.write([b.block_id for b in blocks], 0, ref_kv(A[:7]))
    blocks[0].token_ids, blocks[1].token_ids = A[:4], A[4:7]
    blocks[1].last_accessed, blocks[1].attn_score = 5, 0.25
    kv = src.export_blocks([b.block_id for b in blocks])
    assert [tuple(k.shape) for k, _ in kv] == [(2, 2, BS, 4)] * 2

    dst = make_manager(num_blocks=6, block_size=BS)
    dst.allocate(3)  # the imported blocks land elsewhere in the pool
    got = dst.import_blocks([b.record() for b in blocks], kv)
    assert [b.ref_count for b in got] == [0, 0]
    assert [b.token_ids for b in got] == [A[:4], A[4:7]]
    assert (got[1].last_accessed, got[1].attn_score) == (5, 0.25)
    assert_kv_equal(dst.gather([b.block_id for b in got], 7), ref_kv(A[:7]))


def test_a_failed_import_gives_its_blocks_back() -> None:
    m = make_manager(num_blocks=6, block_size=BS)
    with pytest.raises(KeyError):
        m.import_blocks([{"tokens": [1]}, {}], make_manager().export_blocks([0, 1]))
    with pytest.raises(ValueError, match="holds 5 tokens"):
        m.import_blocks([{"tokens": [1] * 5, "last_accessed": 0, "attn_score": 0.0}],
                        make_manager().export_blocks([0]))
    assert m.num_free == 6 and all(b.ref_count == 0 for b in m.blocks)


def test_the_radix_tree_rebuilds_itself_from_its_records() -> None:
    cache = filled()
    blocks, records = export_blocks(cache.tree)
    assert [b.block_id for b in blocks] == [b.block_id for b in cache.tree.all_blocks()]
    copy = tree_from_blocks(RadixTree(BS), json.loads(json.dumps(records)), blocks)
    copy.check()
    assert [(n.start, n.tokens, n.owners, d) for n, d in copy.nodes()] == [
        (n.start, n.tokens, n.owners, d) for n, d in cache.tree.nodes()
    ]
    assert {id(n) for n in copy.leaves()} == {id(n) for n, _ in copy.nodes() if n.is_leaf}
    with pytest.raises(ValueError, match="not a radix tree"):
        tree_from_blocks(RadixTree(BS), [{"start": 0, "blocks": [0, 0], "children": []}],
                         blocks)


@pytest.mark.parametrize("name", ["lru", "sink-lru", "h2o"])
def test_policies_save_and_restore_their_state(name: str) -> None:
    cache = make_cache(policy=name)
    store(cache, A)
    state = cache.policy.state()
    again = make_policy(name)
    again.restore(json.loads(json.dumps(state)))
    assert again.state() == state
    again.restore({"clock": 0})  # never backwards
    assert again.state() == state
    again.restore({})  # a state from another policy: ignored
    assert again.state() == state
