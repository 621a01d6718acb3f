"""Why a prompt missed: cold, evicted (when, by which policy) or diverged at token i, including a
divergence in the middle of a block, on a live cache (its own eviction writes the tombstones)
and on a tree rebuilt from a saved index, as `kvchat inspect --explain` does."""

from __future__ import annotations

import time

from _cache_helpers import make_cache, store

from kvchat.cache.explain import MissReason, explain
from kvchat.cache.radix import RadixTree
from kvchat.cache.tombstones import Tombstones
from kvchat.cache.tree_index import tree_from_records, tree_records
from kvchat.cache.visibility import Visibility, preview

BS = 4
SYSTEM = list(range(100, 110))  # 10 tokens: ends in the middle of a 4-token block
A = SYSTEM + [1, 2, 3, 4, 5, 6]
B = SYSTEM + [7, 8, 9]


def cache_with(*seqs, num_blocks=32):
    cache = make_cache(num_blocks=num_blocks, block_size=BS)
    for seq in seqs:
        store(cache, seq)
    return cache


def test_a_prompt_sharing_all_that_is_cached_is_a_hit():
    cache = cache_with(A, B)
    e = cache.explain(A + [99])
    assert (e.reason, e.cached, e.prompt_tokens) == (MissReason.HIT, 16, 17)
    assert cache.explain(A, exact=True).cached == len(A)


def test_cold_when_nothing_like_it_was_seen():
    cache = cache_with(A, B)
    e = cache.explain([5, 5, 5, 5, 5])
    assert (e.reason, e.cached, e.diverged_at) == (MissReason.COLD, 0, None)
    beyond = cache.explain(B + [10, 11, 12, 13])  # a cached path to its end, then new ground
    assert (beyond.reason, beyond.cached) == (MissReason.COLD, len(B))
    assert "cold" in beyond.describe(B + [10, 11, 12, 13], None, Visibility.CACHE)


def test_diverged_in_the_middle_of_a_block_says_where_and_what_the_cache_holds():
    cache = cache_with(A, B)
    changed = SYSTEM[:6] + [999] + SYSTEM[7:] + [1, 2]  # token 6 of 10 changed: block 1 of 3
    e = cache.explain(changed)
    assert e.reason is MissReason.DIVERGED and e.diverged_at == 6 and e.cached == 6
    assert e.cached_next[:4] == tuple(SYSTEM[6:10])
    line = e.describe(changed, lambda ids: "".join(f"<{t}>" for t in ids),
                    Visibility.CACHE)
    assert "diverged at token 6" in line and "<106>" in line and "<999>" in line
    inside = cache.explain(SYSTEM + [1, 2, 3, 50, 51])  # parts inside A's own edge
    assert (inside.diverged_at, inside.cached_next) == (13, (4, 5, 6))


def test_in_a_shared_namespace_a_divergence_shows_only_the_callers_own_tokens():
    cache = cache_with(A, B)
    changed = SYSTEM + [1, 2, 42, 43]  # parts inside A's edge: the cache holds 3, 4, 5, 6 next
    e = cache.explain(changed)

    def decode(ids):
        return "".join(f"<{t}>" for t in ids)

    own = e.describe(changed, decode, Visibility.OWN)
    assert own.startswith("diverged at token 12 of 14: new '") and "(not shown)" in own
    assert "<42><43>" in own and "<109><1><2>" in own  # its own tokens on both sides
    assert not any(f"<{t}>" in own for t in (3, 4, 5, 6))  # never what the cache holds next
    assert "<3><4><5><6>" in e.describe(changed, decode, Visibility.CACHE)
    assert preview([3, 4], decode, Visibility.OWN, sent=False) is None
    assert preview([3, 4], None, Visibility.OWN, sent=True) == "3 4"


def test_evicted_says_when_and_by_which_policy():
    cache = cache_with(A, num_blocks=5)  # A takes 4 blocks
    before = time.time()
    store(cache, [50 + i for i in range(11)])  # 3 blocks: A's last two go (leaf first)
    e = cache.explain(A + [77])
    assert e.reason is MissReason.EVICTED and e.cached == 8 and e.evicted_through == len(A)
    assert e.evicted_by == "lru" and e.evicted_at is not None and e.evicted_at >= before
    assert "evicted by lru" in e.describe(A + [77], None, Visibility.CACHE)
    mid = cache.explain(A[:9] + [3, 3, 3])  # parts from an evicted block inside it
    assert (mid.reason, mid.cached, mid.evicted_through) == (MissReason.EVICTED, 8, 9)
    other = explain(cache.tree, A + [77], "tenant", cache.tombstones)
    assert other.reason is MissReason.COLD  # another namespace's chain never matches


def test_clear_is_named_as_the_cause():
    cache = cache_with(A)
    cache.clear()
    e = cache.explain(A + [1])
    assert (e.reason, e.evicted_by, e.evicted_through) == (MissReason.EVICTED, "clear", len(A))


def test_tombstones_are_bounded_and_survive_a_round_trip():
    cache = cache_with(A, num_blocks=5)
    store(cache, [50 + i for i in range(11)])
    saved = Tombstones.from_json(cache.tombstones.to_json(), capacity=cache.tombstones.capacity)
    assert explain(cache.tree, A + [77], "", saved).reason is MissReason.EVICTED
    small = Tombstones(capacity=2)
    for k in range(5):
        small.record(f"{k:064x}", f"{k + 1:064x}", [k], "lru")
    assert len(small) == 2


def test_a_snapshot_tree_explains_like_the_live_one():
    cache = cache_with(A, B)
    rebuilt = tree_from_records(RadixTree(BS), tree_records(cache.tree))
    changed = SYSTEM[:6] + [999] + SYSTEM[7:]
    assert explain(rebuilt, changed) == cache.explain(changed)
    assert explain(rebuilt, B + [1, 2]) == cache.explain(B + [1, 2])


def test_system_prefix_is_the_template_text_before_the_first_user_message(tiny_tokenizer):
    from kvchat.engine.codec import ChatCodec
    from kvchat.turns import system_prefix

    codec = ChatCodec(tiny_tokenizer)
    msgs = [{"role": "system", "content": "You answer in French."},
            {"role": "user", "content": "hello there"}]
    prompt = codec.encode_chat(msgs)
    head = system_prefix(codec, msgs, prompt)
    assert prompt[: len(head)] == head and 0 < len(head) < len(prompt)
    assert "French" in codec.decode(head) and "hello" not in codec.decode(head)
    other = codec.encode_chat([msgs[0], {"role": "user", "content": "something else"}])
    assert other[: len(head)] == head  # what every conversation with this system prompt shares


def test_blocks_only_on_disk_leave_tombstones_when_cleared(tmp_path):
    from _cache_helpers import make_tiered_cache

    cache = make_tiered_cache(tmp_path / "store", num_blocks=6, block_size=BS)
    try:
        store(cache, A)  # 4 blocks
        store(cache, [50 + i for i in range(12)])  # 3 blocks: one of A's spills to disk
        assert any(n.on_disk for n, _ in cache.tree.nodes())
        cache.clear()
        cache.check_integrity()
        e = cache.explain(A + [1])
        assert (e.reason, e.evicted_by, e.evicted_through) == (MissReason.EVICTED, "clear", 16)
    finally:
        assert cache.disk is not None
        cache.disk.close()


def test_blocks_the_disk_budget_dropped_leave_tombstones_at_save(tmp_path):
    from _cache_helpers import make_tiered_cache

    from kvchat.cache.tree_index import export_index

    cache = make_tiered_cache(tmp_path / "store", num_blocks=4, block_size=BS, budget_bytes=6000)
    try:
        for k in range(6):  # far more than the pool and the disk budget hold
            store(cache, [10 * k + i for i in range(8)])
        meta = export_index(cache)
        cache.check_integrity()
        assert any(row[-1] == "disk budget" for row in meta["tombstones"])
        e = cache.explain(list(range(8)) + [99])
        assert (e.reason, e.evicted_by) == (MissReason.EVICTED, "disk budget")
    finally:
        assert cache.disk is not None
        cache.disk.close()


def test_labels_read_a_new_message_and_a_shared_system_prompt_as_normal():
    cache = cache_with(A)
    other_row = cache.explain(B + [10])  # shares SYSTEM with A, then its own text
    assert other_row.reason is MissReason.DIVERGED  # the stable value programs read
    assert other_row.label(own_from=len(SYSTEM)) == "shared prefix"
    assert other_row.label(own_from=len(SYSTEM), after_history=True) == "new"  # a rewound turn
    next_turn = cache.explain(A + [40, 41, 42])  # the whole history cached, then the message
    assert (next_turn.reason, next_turn.label(own_from=len(A), after_history=True)) == (
        MissReason.COLD, "new")
    # a miss before the request's own text starts keeps its plain reason
    changed_system = cache.explain(SYSTEM[:5] + [0] * 8)
    assert changed_system.label(own_from=len(SYSTEM)) == "diverged"
    assert cache.explain([9, 9, 9]).label(own_from=2) == "cold"
    assert cache.explain(A + [1], exact=True).label(own_from=3) == "hit"
