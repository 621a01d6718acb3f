"""PagedKVCache: two-layer lookup, store, eviction through the policy, counters, integrity.

K/V come from `ref_kv`, a function of the token prefix only (as in a causal model), so every hit
can be checked bitwise against what a cold computation would give."""

from __future__ import annotations

import pytest
import torch
from _cache_helpers import (
    N_LAYERS,
    assert_hit_correct,
    assert_kv_equal,
    fetch,
    in_node,
    make_cache,
    ref_kv,
    store,
)

from kvchat.cache.blocks import BlockManager
from kvchat.cache.kvcache import PagedKVCache
from kvchat.cache.lookup import CacheIntegrityError, HitSource
from kvchat.config import CacheConfig, ConfigError

BS = 4


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def cached(cache: PagedKVCache, tokens: list[int]) -> int:
    """How many leading tokens of `tokens` the tree holds (no side effects)."""
    return cache.peek(tokens)


# ---- lookup ----------------------------------------------------------------------------------


def test_exact_repeat_with_logits_needs_no_forward() -> None:
    cache = make_cache()
    tokens = seq(0, 10)
    row = torch.randn(32)
    store(cache, tokens, logits=row)
    hit = cache.lookup(tokens, sid="s")
    cache.check_integrity()
    assert hit.source is HitSource.EXACT and hit.source == "exact"
    assert hit.matched == 10 == hit.prompt_tokens
    assert hit.logits is not None and torch.equal(hit.logits, row)
    assert len(hit.blocks) == 3 and all(b.ref_count == 1 for b in hit.blocks)
    assert_hit_correct(cache, hit, tokens)
    cache.release(hit.blocks)
    cache.check_integrity()
    s = cache.stats()
    assert (s.exact_hits, s.hit_count, s.miss_count, s.hit_tokens) == (1, 1, 0, 10)


@pytest.mark.parametrize("n", [10, 8, 1])
def test_a_full_match_without_logits_leaves_one_token_to_compute(n: int) -> None:
    cache = make_cache()
    tokens = seq(0, n)
    store(cache, tokens)
    hit = fetch(cache, tokens)
    assert hit.matched == n - 1
    assert hit.source is (HitSource.RADIX if n > 1 else HitSource.MISS)
    assert hit.logits is None
    assert len(hit.blocks) == -(-(n - 1) // BS)


def test_an_exact_entry_does_not_serve_a_prefix_or_an_extension() -> None:
    cache = make_cache()
    tokens = seq(0, 10)
    store(cache, tokens, logits=torch.zeros(4))
    assert fetch(cache, tokens[:7]).source is HitSource.RADIX
    longer = fetch(cache, [*tokens, 99])
    assert (longer.source, longer.matched, longer.logits) == (HitSource.RADIX, 10, None)


def test_miss() -> None:
    cache = make_cache()
    store(cache, seq(0, 6))
    hit = fetch(cache, seq(100, 6))
    assert (hit.matched, hit.blocks, hit.source, hit.logits) == (0, (), HitSource.MISS, None)
    assert fetch(cache, []).source is HitSource.MISS


def test_counters_and_per_session_counters() -> None:
    cache = make_cache()
    store(cache, seq(0, 10), logits=torch.zeros(2))
    fetch(cache, seq(0, 10))  # exact: 10 of 10, no session
    for tokens, sid in [
        (seq(0, 6), "a"),  # radix: 5 of 6
        (seq(50, 4), "a"),  # miss
        ([*seq(0, 10), 7, 7], "b"),  # radix: 10 of 12
    ]:
        hit = cache.lookup(tokens, sid=sid)
        cache.release(hit.blocks)
    s = cache.stats()
    assert (s.hit_count, s.miss_count, s.exact_hits) == (3, 1, 1)
    assert (s.hit_tokens, s.lookup_tokens) == (25, 32)
    assert s.hit_rate == pytest.approx(3 / 4) and s.token_hit_rate == pytest.approx(25 / 32)
    a, b = s.sessions["a"], s.sessions["b"]
    assert (a.lookups, a.hits, a.prompt_tokens, a.hit_tokens) == (2, 1, 10, 5)
    assert (b.lookups, b.hits, b.prompt_tokens, b.hit_tokens) == (1, 1, 12, 10)
    assert a.hit_rate == pytest.approx(0.5)
    d = s.to_json()
    assert d["hit_count"] == 3 and d["exact_hits"] == 1 and d["policy"] == "lru"
    assert (d["hit_rate"], d["token_hit_rate"]) == (s.hit_rate, s.token_hit_rate)
    assert d["sessions"] == {
        "a": {"lookups": 2, "hits": 1, "prompt_tokens": 10, "hit_tokens": 5, "hit_rate": 0.5},
        "b": {
            "lookups": 1, "hits": 1, "prompt_tokens": 12, "hit_tokens": 10, "hit_rate": 10 / 12
        },
    }
    # the snapshot is a copy: later lookups do not change it
    cache.release(cache.lookup(seq(0, 6), sid="a").blocks)
    assert s.sessions["a"].lookups == 2


def test_pool_and_tree_stats() -> None:
    cache = make_cache(num_blocks=10)
    store(cache, seq(0, 10))
    store(cache, [*seq(0, 5), 90, 91])  # diverges inside block 1: splits at 4
    s = cache.stats()
    assert (s.pool.total_blocks, s.pool.used_blocks, s.pool.free_blocks) == (10, 4, 6)
    assert s.pool.utilisation == pytest.approx(0.4)
    # stores without logits add no exact entries: only logits let a repeat skip the forward
    assert (s.tree_nodes, s.tree_tokens, s.exact_entries) == (3, 4 + 6 + 3, 0)
    assert s.stored_tokens == 10 + 2  # the copied shared head is not new K/V
    pool = s.to_json()["pool"]
    assert (pool["total_blocks"], pool["used_blocks"], pool["free_blocks"]) == (10, 4, 6)
    assert (pool["block_size"], pool["cached_tokens"], pool["utilisation"]) == (4, 13, 0.4)


def test_lookup_touches_stats_peek_does_not() -> None:
    cache = make_cache()
    store(cache, seq(0, 8))
    before = [b.last_accessed for b in cache.manager.blocks]
    assert cache.peek(seq(0, 8)) == 8  # not capped: peek reports what the tree holds
    assert [b.last_accessed for b in cache.manager.blocks] == before
    assert cache.stats().hit_count + cache.stats().miss_count == 0
    hit = fetch(cache, seq(0, 8))
    assert all(b.last_accessed > before[b.block_id] for b in hit.blocks)


# ---- store -----------------------------------------------------------------------------------


def test_store_with_skip_tokens_writes_only_the_tail() -> None:
    cache = make_cache()
    a = seq(0, 10)
    store(cache, a)
    b = [*a, *seq(40, 6)]
    hit = cache.lookup(b)
    assert hit.matched == 10
    res = cache.write_kv(b, ref_kv(b, hit.matched), hit.matched, hold=True)
    cache.check_integrity()
    assert (res.stored, res.new_tokens, res.complete, res.evicted) == (16, 6, True, 0)
    assert len(res.blocks) == 4 and all(blk.ref_count == 2 for blk in res.blocks[:3])
    cache.release(hit.blocks)
    cache.release(res.blocks)
    cache.check_integrity()
    assert all(blk.ref_count == 0 for blk in cache.manager.blocks)
    assert fetch(cache, [*b, 1]).matched == 16


def test_store_checks_the_kv_length() -> None:
    cache = make_cache()
    with pytest.raises(ValueError, match="covers 3 positions, expected 4"):
        cache.write_kv(seq(0, 6), ref_kv(seq(0, 6), 3), 2)
    cache.check_integrity()


def test_store_of_a_cached_sequence_writes_nothing_and_hands_back_its_blocks() -> None:
    cache = make_cache()
    first = store(cache, seq(0, 10))
    again = cache.write_kv(seq(0, 10), ref_kv(seq(0, 10), 10), 10, hold=True)
    cache.check_integrity()
    assert (again.stored, again.new_tokens, again.complete) == (10, 0, True)
    assert [b.block_id for b in again.blocks] == [b.block_id for b in first.blocks]
    assert all(b.ref_count == 1 for b in again.blocks)
    cache.release(again.blocks)
    assert cache.stats().stored_tokens == 10


def test_store_takes_no_reference_unless_asked_to_hold() -> None:
    cache = make_cache(num_blocks=4)
    res = cache.write_kv(seq(0, 8), ref_kv(seq(0, 8)), 0)
    cache.check_integrity()
    assert res.stored == 8 and all(b.ref_count == 0 for b in res.blocks)
    # the blocks are the tree's: the next mutation may evict them
    assert cache.evict(4) == 2
    cache.check_integrity()
    held = cache.write_kv(seq(0, 8), ref_kv(seq(0, 8)), 0, hold=True)
    assert all(b.ref_count == 1 for b in held.blocks)
    assert cache.evict(4) == 0  # held blocks are never evicted
    cache.release(held.blocks)
    cache.check_integrity()
    assert cache.evict(4) == 2


def test_store_when_the_prefix_it_skips_is_gone_stores_nothing() -> None:
    cache = make_cache()
    store(cache, seq(0, 8))
    hit = cache.lookup([*seq(0, 8), 1])
    cache.release(hit.blocks)
    cache.evict(10)
    tokens = [*seq(0, 8), 1, 2]
    res = cache.write_kv(tokens, ref_kv(tokens, hit.matched), hit.matched)
    cache.check_integrity()
    assert (res.stored, res.new_tokens, res.complete, res.blocks) == (0, 0, False, ())


def test_logits_len_keys_the_logits_by_the_prompt() -> None:
    cache = make_cache()
    prompt, generated = seq(0, 6), [70, 71, 72]
    row = torch.randn(5)
    store(cache, prompt + generated, logits=row, logits_len=len(prompt))
    hit = fetch(cache, prompt)
    assert hit.source is HitSource.EXACT and hit.matched == 6 and torch.equal(hit.logits, row)
    assert fetch(cache, prompt + generated).source is HitSource.RADIX


def test_restoring_a_cached_prompt_keeps_its_logits() -> None:
    # an exact hit that generates one token stores the prompt again, without logits
    cache = make_cache()
    tokens = seq(0, 6)
    row = torch.randn(5)
    store(cache, tokens, logits=row)
    hit = cache.lookup(tokens)
    store(cache, tokens, skip=hit.matched)
    cache.release(hit.blocks)
    again = fetch(cache, tokens)
    assert again.source is HitSource.EXACT and torch.equal(again.logits, row)


# ---- bitwise K/V round trips -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("stored", "query", "matched"),
    [
        ([seq(0, 8)], [*seq(0, 8), 5], 8),  # full: whole blocks
        ([seq(0, 12)], [*seq(0, 6), 5, 5], 6),  # partial: ends inside block 1
        ([seq(0, 12), [*seq(0, 9), 50, 51, 52]], [*seq(0, 9), 50, 51, 52, 9], 12),  # unaligned
        ([seq(0, 6), seq(0, 11)], [*seq(0, 11), 0], 11),  # a leaf extended in place
        ([seq(0, 12), [*seq(0, 2), 60, 61, 62]], [*seq(0, 2), 60, 61, 7], 4),  # branch in block 0
    ],
    ids=["full", "partial", "unaligned", "extended", "root-branch"],
)
def test_kv_read_back_equals_kv_written(
    stored: list[list[int]], query: list[int], matched: int
) -> None:
    cache = make_cache()
    for tokens in stored:
        hit = cache.lookup(tokens)
        store(cache, tokens, skip=hit.matched)
        cache.release(hit.blocks)
    hit = fetch(cache, query)  # checks every layer, K and V, bitwise
    assert hit.matched == matched
    for tokens in stored:  # and nothing stored earlier was overwritten
        assert fetch(cache, [*tokens, -1]).matched == len(tokens)


def test_47_shared_tokens_with_block_size_64_hit_47() -> None:
    cache = make_cache(num_blocks=8, block_size=64)
    a = seq(0, 100)
    b = [*seq(0, 47), *seq(1000, 53)]
    store(cache, a)
    hit = cache.lookup(b)
    assert (hit.matched, hit.source) == (47, HitSource.RADIX)
    assert_hit_correct(cache, hit, b)
    res = cache.write_kv(b, ref_kv(b, 47), 47)
    cache.check_integrity()
    assert (res.stored, res.new_tokens) == (100, 53)
    assert res.blocks[0] is not hit.blocks[0]  # the shared 47 were copied into b's own block
    cache.release(hit.blocks)
    cache.check_integrity()
    for tokens in (a, b):
        full = fetch(cache, [*tokens, -1])
        assert full.matched == 100


def test_gather_is_per_layer_and_distinguishes_k_from_v() -> None:
    cache = make_cache()
    tokens = seq(0, 7)
    store(cache, tokens)
    hit = cache.lookup([*tokens, 0])
    got = cache.gather(hit.blocks, hit.matched)
    want = ref_kv(tokens)
    assert len(got) == N_LAYERS
    assert_kv_equal(got, want)
    with pytest.raises(AssertionError):
        assert_kv_equal(got, [(v, k) for k, v in want])  # the check can fail
    cache.release(hit.blocks)


# ---- eviction --------------------------------------------------------------------------------


def test_lru_evicts_the_oldest_leaf_block() -> None:
    cache = make_cache(policy="lru")
    s1, s2, s3 = seq(0, 4), seq(10, 4), seq(20, 4)
    for s in (s1, s2, s3):
        store(cache, s)
    fetch(cache, s1)  # s1 is now the most recent
    assert cache.evict(1) == 1
    cache.check_integrity()
    assert [cached(cache, s) for s in (s1, s2, s3)] == [4, 0, 4]
    assert cache.evict(1) == 1
    assert [cached(cache, s) for s in (s1, s2, s3)] == [4, 0, 0]
    assert cache.stats().eviction_count == 2


def test_sink_lru_never_evicts_a_first_block_even_the_oldest() -> None:
    cache = make_cache(policy="sink-lru")
    old, new = seq(0, 4), seq(10, 8)
    store(cache, old)  # one block: a first block, and the oldest of all
    store(cache, new)
    assert cache.evict(1) == 1
    cache.check_integrity()
    assert (cached(cache, old), cached(cache, new)) == (4, 4)
    assert cache.evict(5) == 0  # only first blocks are left
    assert (cached(cache, old), cached(cache, new)) == (4, 4)
    assert all(b.is_first_block for b in cache.tree.all_blocks())
    lru = make_cache(policy="lru")
    store(lru, old)
    store(lru, new)
    lru.evict(1)
    assert (cached(lru, old), cached(lru, new)) == (0, 8)


def test_h2o_evicts_the_lowest_attention_mass_leaf_block() -> None:
    cache = make_cache(policy="h2o")
    s1, s2, s3 = seq(0, 8), seq(10, 8), seq(20, 8)
    blocks = [store(cache, s, hold=True).blocks for s in (s1, s2, s3)]
    # s1's tail is the oldest, but it was attended to; s2's tail was not much
    cache.record_attention([blocks[0][1], blocks[1][1], blocks[2][1]], [0.8, 0.1, 0.5])
    cache.record_attention([b[0] for b in blocks], [0.0, 0.0, 0.0])  # first blocks: protected
    for held in blocks:
        cache.release(held)
    assert cache.evict(1) == 1
    cache.check_integrity()
    assert [cached(cache, s) for s in (s1, s2, s3)] == [8, 4, 8]
    assert cache.evict(1) == 1
    assert [cached(cache, s) for s in (s1, s2, s3)] == [8, 4, 4]
    assert cache.evict(3) == 1  # then s1's tail; first blocks never go
    assert [cached(cache, s) for s in (s1, s2, s3)] == [4, 4, 4]


def test_h2o_without_scores_falls_back_to_age() -> None:
    cache = make_cache(policy="h2o")
    s1, s2 = seq(0, 8), seq(10, 8)
    store(cache, s1)
    store(cache, s2)
    cache.evict(1)
    assert (cached(cache, s1), cached(cache, s2)) == (4, 8)


@pytest.mark.parametrize("policy", ["lru", "sink-lru", "h2o"])
def test_leaf_first_a_block_with_cached_descendants_outlives_them(policy: str) -> None:
    cache = make_cache(num_blocks=16, policy=policy)
    trunk = seq(0, 8)
    store(cache, trunk)  # the trunk's blocks are the oldest
    left, right = [*trunk, *seq(40, 8)], [*trunk, *seq(60, 5)]
    for tail in (left, right):
        hit = cache.lookup(tail)
        store(cache, tail, skip=hit.matched)
        cache.release(hit.blocks)
    protected = 1 if policy != "lru" else 0
    history = []
    while True:
        lengths = (cached(cache, left), cached(cache, right))
        history.append(lengths)
        # the trunk stays whole while either branch still has anything past it
        if max(lengths) > 8:
            assert min(lengths) >= 8
        if cache.evict(1) == 0:
            break
        cache.check_integrity()
    assert history[-1] == (4 * protected, 4 * protected)
    assert cache.stats().pool.used_blocks == protected


def test_evicted_blocks_leave_the_tree_and_the_exact_index() -> None:
    cache = make_cache()
    a, b = seq(0, 8), seq(20, 8)
    store(cache, a, logits=torch.ones(3))
    store(cache, b, logits=torch.ones(3))
    fetch(cache, b)
    assert cache.evict(1) == 1  # a's tail
    cache.check_integrity()
    assert tuple(a) not in cache.exact and tuple(b) in cache.exact
    hit = fetch(cache, a)
    assert (hit.source, hit.matched) == (HitSource.RADIX, 4)
    assert cache.evict(10) == 3
    assert len(cache.exact) == 0 and list(cache.tree.nodes()) == []
    assert fetch(cache, b).source is HitSource.MISS
    assert cache.stats().pool.free_blocks == 16


def test_blocks_held_by_a_caller_are_never_evicted() -> None:
    cache = make_cache(num_blocks=8)
    a, b = seq(0, 8), seq(20, 8)
    store(cache, a)
    store(cache, b)
    held = cache.lookup([*a, 1])  # holds both of a's blocks
    kept = store(cache, seq(40, 4), hold=True)  # a store with hold=True holds its blocks too
    assert cache.evict(100) == 2  # only b's
    cache.check_integrity()
    assert (cached(cache, a), cached(cache, b), cached(cache, seq(40, 4))) == (8, 0, 4)
    assert_hit_correct(cache, held, a)
    cache.release(held.blocks)
    cache.release(kept.blocks)
    assert cache.evict(100) == 3
    cache.check_integrity()


def test_store_evicts_to_make_room() -> None:
    cache = make_cache(num_blocks=4)
    old = seq(0, 8)
    store(cache, old)
    new = seq(50, 16)
    res = store(cache, new)
    assert (res.stored, res.complete, res.evicted) == (16, True, 2)
    assert cached(cache, old) == 0
    assert fetch(cache, [*new, 0]).matched == 16


def test_store_never_evicts_its_own_path() -> None:
    cache = make_cache(num_blocks=4)
    a = seq(0, 8)
    store(cache, a)
    longer = [*a, *seq(30, 8)]  # needs 2 more blocks: only 2 free, a's 2 are its own prefix
    hit = cache.lookup(longer)
    cache.release(hit.blocks)  # the store must protect the prefix by itself
    res = store(cache, longer, skip=8)
    assert (res.stored, res.complete, res.evicted) == (16, True, 0)
    # a branch off a's end needing 3 blocks: the pool is full, and only `longer`'s tail
    # (2 blocks) may go, so 2 of the 3 fit
    longer2 = [*a, *seq(60, 12)]
    res = store(cache, longer2, skip=8)
    assert (res.stored, res.complete, res.evicted) == (16, False, 2)
    assert (cached(cache, a), cached(cache, longer)) == (8, 8)
    assert fetch(cache, [*longer2[:16], -1]).matched == 16


def test_a_sequence_too_big_for_the_pool_stores_the_longest_prefix_that_fits() -> None:
    cache = make_cache(num_blocks=4)
    big = seq(0, 22)
    res = store(cache, big, logits=torch.ones(2))
    assert (res.stored, res.new_tokens, res.complete) == (16, 16, False)
    assert len(cache.exact) == 0  # the logits belong to position 21, which is not cached
    assert fetch(cache, big).matched == 16


def test_no_room_at_all_stores_nothing_and_does_not_raise() -> None:
    cache = make_cache(num_blocks=2, policy="sink-lru")
    store(cache, seq(0, 4))
    store(cache, seq(10, 4))  # two first blocks: unevictable under sink-lru
    tokens = seq(20, 6)
    res = store(cache, tokens)
    assert (res.stored, res.new_tokens, res.complete, res.blocks) == (0, 0, False, ())
    held = cache.lookup([*seq(0, 4), 1])
    res = store(cache, [*seq(0, 4), 1, 2], skip=4)  # a tail with no block to go in
    assert (res.stored, res.complete) == (4, False)
    assert [b.block_id for b in res.blocks] == [b.block_id for b in held.blocks]
    cache.release(held.blocks)
    cache.check_integrity()


def test_clear_drops_everything_nobody_holds() -> None:
    cache = make_cache(num_blocks=12, policy="sink-lru")
    a, b = seq(0, 10), seq(20, 7)
    store(cache, a, logits=torch.zeros(1))
    store(cache, b)
    held = cache.lookup(b)  # 6 tokens -> 2 blocks held
    freed = cache.clear()
    cache.check_integrity()
    assert freed == 3  # all of a, first block included
    assert len(cache.exact) == 0
    assert (cached(cache, a), cached(cache, b)) == (0, 7)  # b's held blocks remain whole
    assert_hit_correct(cache, held, b)
    cache.release(held.blocks)
    assert cache.clear() == 2
    cache.check_integrity()
    s = cache.stats()
    assert (s.pool.used_blocks, s.tree_nodes, s.tree_tokens) == (0, 0, 0)


# ---- construction ----------------------------------------------------------------------------


def test_create_sizes_the_pool_from_the_budget() -> None:
    cfg = CacheConfig(block_size=16, cache_mb=1.0, policy="h2o")
    cache = PagedKVCache.create(cfg, n_layers=2, n_kv_heads=2, head_dim=4)
    # 2 (K, V) * 2 layers * 2 heads * 4 dims * 4 bytes = 128 B a token, 2 KiB a block
    assert cache.manager.num_blocks == 512
    assert cache.policy.name == "h2o" and cache.block_size == 16
    explicit = PagedKVCache.create(
        CacheConfig(block_size=8, num_blocks=5), 1, 1, 2, dtype=torch.bfloat16
    )
    assert explicit.manager.num_blocks == 5
    assert explicit.manager.block_tensors(0)[0][0].dtype == torch.bfloat16
    assert explicit.exact.max_entries == 256


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="block-size"):
        CacheConfig(block_size=0)
    with pytest.raises(ConfigError, match="cache-mb"):
        CacheConfig(cache_mb=0)
    with pytest.raises(ConfigError, match="at least one block"):
        CacheConfig(num_blocks=0)


def test_policy_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVICTION_POLICY", "sink-lru")
    manager = BlockManager(4, 4, 1, 1, 2)
    assert PagedKVCache(manager).policy.name == "sink-lru"
    assert PagedKVCache(manager, "h2o").policy.name == "h2o"
    monkeypatch.setenv("EVICTION_POLICY", "mru")
    with pytest.raises(ConfigError, match="lru, sink-lru, h2o"):
        PagedKVCache(manager)


# ---- check_integrity can fail ----------------------------------------------------------------


def test_check_integrity_catches_a_leaked_block() -> None:
    cache = make_cache()
    store(cache, seq(0, 6))
    cache.manager.allocate(1)
    with pytest.raises(CacheIntegrityError, match="owned by nothing"):
        cache.check_integrity()


def test_check_integrity_catches_a_freed_block_still_in_the_tree() -> None:
    cache = make_cache()
    res = store(cache, seq(0, 6))
    cache.manager.free([res.blocks[1]])
    with pytest.raises(CacheIntegrityError):
        cache.check_integrity()


def test_check_integrity_catches_a_free_block_pointing_at_a_node() -> None:
    cache = make_cache()
    res = store(cache, seq(0, 6))
    free = cache.manager.blocks[cache.manager.free_ids[0]]
    free.node, free.index = res.blocks[0].node, 0  # would read that edge's tokens
    with pytest.raises(CacheIntegrityError, match="points at a tree node"):
        cache.check_integrity()


def test_check_integrity_catches_an_exact_entry_on_a_block_outside_the_tree() -> None:
    cache = make_cache()
    store(cache, seq(0, 6))
    stray = cache.manager.allocate(1)[0]
    in_node([stray], [9])  # holds the entry's tokens, but in a node the tree lacks
    stray.release()
    cache.exact.put([9], [stray])
    with pytest.raises(CacheIntegrityError):
        cache.check_integrity()


@pytest.mark.parametrize("where", ["write", "insert"])
def test_an_interrupted_store_gives_its_new_blocks_back(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache(num_blocks=8)
    store(cache, seq(0, 6))
    target = cache.manager if where == "write" else cache.tree

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(target, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.write_kv(seq(0, 14), ref_kv(seq(0, 14), 6), 6)
    monkeypatch.undo()
    cache.check_integrity()
    assert cache.manager.num_free == 6 and cache.peek(seq(0, 14)) == 6
    assert all(b.ref_count == 0 for b in cache.manager.blocks)
