"""Pinned prefixes: eviction never takes their blocks, they never spill, the cap refuses a pin
that would pass it (changing nothing), and a saved index pins them again."""

from __future__ import annotations

import pytest
from _cache_helpers import fetch, make_cache, make_tiered_cache, store

from kvchat.cache.pins import PinError
from kvchat.cache.tree_index import export_index, import_index

SYSTEM = list(range(100, 110))  # 10 tokens, 3 blocks of 4


def test_a_pinned_system_prompt_survives_pressure_that_evicts_everything_else():
    cache = make_cache(num_blocks=8, block_size=4)
    store(cache, SYSTEM + [1, 2, 3, 4, 5])
    pin = cache.pin(SYSTEM, label="system prompt")
    assert len(pin.block_ids) == 3
    for k in range(6):  # each 8-token sequence needs 2 blocks: far more than the 5 left
        store(cache, [200 + k] * 8)
        cache.check_integrity()
    assert set(pin.block_ids) <= {b.block_id for b in cache.tree.all_blocks()}
    assert fetch(cache, SYSTEM + [9]).matched == len(SYSTEM)
    # the rest went: only the pinned blocks are left, the last with the 2 tokens after SYSTEM
    assert fetch(cache, SYSTEM + [1, 2, 3, 4, 5, 6]).matched == len(SYSTEM) + 2
    cache.unpin(pin.pin_id)
    store(cache, [300] * 32)  # the whole pool: now the system prompt goes too
    assert fetch(cache, SYSTEM + [9]).matched == 0


def test_the_cap_refuses_clearly_and_changes_nothing():
    cache = make_cache(num_blocks=8, block_size=4)  # cap 50%: 4 blocks
    store(cache, SYSTEM)
    store(cache, [7] * 12)
    cache.pin(SYSTEM)
    with pytest.raises(PinError, match="max-pinned"):
        cache.pin([7] * 12)  # 3 more blocks: 6 > 4
    assert len(cache.pins) == 1 and len(cache.pins.block_ids) == 3
    assert cache.pin(SYSTEM).pin_id == next(iter(cache.pins)).pin_id  # pinning twice is one pin
    cache.check_integrity()


def test_only_a_cached_prefix_can_be_pinned():
    cache = make_cache(num_blocks=8, block_size=4)
    store(cache, SYSTEM[:5])
    with pytest.raises(PinError, match="5 of the 10"):
        cache.pin(SYSTEM)
    with pytest.raises(PinError):
        cache.pin([])


def test_pinned_blocks_never_spill_and_a_saved_index_pins_them_again(tmp_path):
    cache = make_tiered_cache(tmp_path / "store", num_blocks=8, block_size=4)
    try:
        store(cache, SYSTEM + [1, 2])
        cache.pin(SYSTEM, label="system prompt")
        for k in range(4):
            store(cache, [200 + k] * 8)
        assert all(not n.on_disk for n, _ in cache.tree.nodes()
                   if n.start == 0 and n.tokens[:10] == SYSTEM)
        meta = export_index(cache)
        assert meta["pins"][0]["label"] == "system prompt"
        assert any(r.get("pinned") for r in meta["tree"])
        fresh = make_cache(num_blocks=8, block_size=4)
        fresh.use_store(cache.disk, {"model": "test"})
        import_index(fresh, meta)
        assert [p.tokens for p in fresh.pins] == [tuple(SYSTEM)]
        fresh.check_integrity()
        assert fresh.take_notices() == []
    finally:
        assert cache.disk is not None
        cache.disk.close()


def test_clear_and_reset_drop_pins():
    cache = make_cache(num_blocks=8, block_size=4)
    store(cache, SYSTEM)
    cache.pin(SYSTEM)
    cache.clear()
    assert len(cache.pins) == 0 and cache.manager.num_free == 8
    cache.check_integrity()
