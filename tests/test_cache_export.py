"""PagedKVCache.export() / restore(): a cache's state as plain data (CacheState), and back.

The snapshot (`tree_index`) is this state as JSON; here the state itself round-trips: a restored
cache holds the same tree, counters, tombstones, pins and exact entries, passes
check_integrity(), and serves the same prompts with the same K/V from the disk tier."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _cache_helpers import fetch, make_cache, make_tiered_cache, store

from kvchat.cache.explain import MissReason
from kvchat.cache.kvcache import PagedKVCache
from kvchat.cache.lookup import HitSource
from kvchat.cache.state import CacheState, SnapshotMismatch
from kvchat.cache.tree_index import read_state, state_document

BS = 4
A = list(range(1, 15))  # 3 full blocks and a partial one
B = [*range(1, 9), 40, 41, 42, 43, 44]  # shares two blocks with A


def filled(root: Path) -> tuple[PagedKVCache, torch.Tensor]:
    """A tiered cache with two sessions' prompts, an exact entry, a pin, and blocks the disk
    budget pruned (tombstones), persisted."""
    cache = make_tiered_cache(root, num_blocks=8, block_size=BS, budget_bytes=6000)
    for k in range(6):  # past the disk budget: some blocks are pruned
        store(cache, [100 + 10 * k + i for i in range(8)])
    logits = torch.arange(6.0)
    store(cache, A, sid="s1", logits=logits)
    store(cache, B, sid="s2")
    cache.release(cache.lookup(B + [1], sid="s2").blocks)  # per-session counters
    cache.pin(A[:8], label="system")
    cache.persist()
    cache.check_integrity()
    return cache, logits


def restored(root: Path, state: CacheState, rows: dict[str, torch.Tensor]) -> PagedKVCache:
    again = make_tiered_cache(root, num_blocks=8, block_size=BS)
    again.restore(state, rows.get)
    again.check_integrity()
    return again


def test_restore_of_export_gives_the_same_cache(tmp_path: Path) -> None:
    cache, logits = filled(tmp_path)
    state = cache.export()
    assert state.tombstones and state.pins and state.exact and state.counters.sessions
    assert any(rec.pinned for rec in state.tree)
    rows = {e.logits: logits for e in state.exact}
    assert cache.disk is not None
    cache.disk.close()

    again = restored(tmp_path, state, rows)
    back = again.export()
    # the pin's blocks were loaded back into the pool (pinned blocks never stay on disk)
    assert back.resident_blocks == len(again.pins.block_ids) == 2
    # ... counted as disk loads; the policy's clock never runs back
    assert back.counters.disk_loads == state.counters.disk_loads + 2
    assert back.policy_state["clock"] >= state.policy_state["clock"]
    assert replace(back, policy_state=state.policy_state, resident_blocks=state.resident_blocks,
                   disk_tokens=state.disk_tokens,
                   counters=replace(back.counters, disk_loads=state.counters.disk_loads)) == state

    hit = fetch(again, A)  # exact again: its path loads from disk, its logits from `rows`
    assert hit.source is HitSource.EXACT and hit.logits is not None
    assert torch.equal(hit.logits, logits)
    hit = fetch(again, B + [7])  # fetch checks the K/V read back against the reference
    assert hit.source is HitSource.DISK and hit.matched == len(B)
    # misses explain alike: the tombstones came along
    whys = [again.explain([100 + 10 * k + i for i in range(8)] + [1]) for k in range(6)]
    assert whys == [cache.explain([100 + 10 * k + i for i in range(8)] + [1]) for k in range(6)]
    assert any((w.reason, w.evicted_by) == (MissReason.EVICTED, "disk budget") for w in whys)
    assert again.disk is not None
    again.disk.close()


def test_the_state_survives_its_json_document(tmp_path: Path) -> None:
    cache, _ = filled(tmp_path)
    state = cache.export()
    assert read_state(json.loads(json.dumps(state_document(state)))) == state
    assert cache.disk is not None
    cache.disk.close()


def test_restore_refuses_a_state_that_does_not_fit_and_leaves_the_cache_empty(
        tmp_path: Path) -> None:
    cache, _ = filled(tmp_path)
    state = cache.export()
    assert cache.disk is not None
    cache.disk.close()
    again = make_tiered_cache(tmp_path, num_blocks=8, block_size=BS)
    for bad, why in [(replace(state, block_size=8), "block size"),
                     (replace(state, shape=(9, 9, 9)), "K/V shape")]:
        with pytest.raises(SnapshotMismatch, match=why):
            again.restore(bad)
        assert again.tree.num_tokens == 0 and not again.exact.saved() and not len(again.pins)
        again.check_integrity()
    store(again, A)
    with pytest.raises(SnapshotMismatch, match="not empty"):
        again.restore(state)
    again.check_integrity()
    assert again.disk is not None
    again.disk.close()


def test_restore_without_a_disk_tier_is_refused_as_damaged() -> None:
    """Every restored block is on disk: a cache with no tier cannot hold that tree."""
    with_disk = make_cache(num_blocks=8, block_size=BS)
    store(with_disk, A)
    state = with_disk.export()
    fresh = make_cache(num_blocks=8, block_size=BS)
    with pytest.raises(SnapshotMismatch, match="blocks on disk, no tier"):
        fresh.restore(state)
    assert fresh.tree.num_tokens == 0
