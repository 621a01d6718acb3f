"""The disk tier inside the cache: evicted blocks spill to a BlockStore, stay in the tree, and
come back on a hit (HitSource.DISK) with the K/V they had; damaged files are never served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cache_helpers import assert_hit_correct, make_tiered_cache, ref_kv

from kvchat.cache.kvcache import HitSource, PagedKVCache
from kvchat.cache.store_index import block_path
from kvchat.cache.tree_index import export_index, import_index

BS = 4
A = list(range(1, 15))  # 14 tokens: 3 full blocks and a partial one
B = [*range(1, 9), 40, 41, 42, 43, 44]  # shares two blocks with A


def put(cache: PagedKVCache, tokens: list[int]) -> None:
    cache.store(tokens, ref_kv(tokens), 0)
    cache.check_integrity()


def look(cache: PagedKVCache, tokens: list[int]):  # noqa: ANN201
    hit = cache.lookup(tokens)
    cache.check_integrity()
    assert_hit_correct(cache, hit, tokens)
    cache.release(hit.blocks)
    cache.check_integrity()
    return hit


def test_evicted_blocks_spill_to_disk_and_a_lookup_loads_them_back(tmp_path: Path) -> None:
    cache = make_tiered_cache(tmp_path, num_blocks=8, block_size=BS)
    put(cache, A)
    put(cache, B)
    assert cache.evict(8) == 6  # every block: now only on disk
    assert cache.manager.num_free == 8
    assert cache.stats().disk_tokens == len(A) + len(B) - 8
    assert cache.peek(A + [99]) == len(A)  # peek counts both tiers and touches nothing
    hit = look(cache, A + [99])
    assert hit.source is HitSource.DISK and hit.matched == len(A) and hit.disk_tokens == len(A)
    hit = look(cache, A + [99])
    assert hit.source is HitSource.RADIX and hit.disk_tokens == 0  # resident again
    stats = cache.stats()
    assert stats.disk_hits == 1 and stats.disk_hit_tokens == len(A) and stats.spilled_blocks == 6
    assert cache.disk is not None
    cache.disk.close()


def test_a_pool_full_of_other_prompts_makes_room_for_a_disk_hit(tmp_path: Path) -> None:
    cache = make_tiered_cache(tmp_path, num_blocks=4, block_size=BS)
    put(cache, A)  # 4 blocks: the whole pool
    put(cache, B)  # spills A's tail to make room
    hit = look(cache, A + [99])
    assert hit.matched == len(A) and hit.source is HitSource.DISK
    assert look(cache, B).matched == len(B) - 1
    assert cache.disk is not None
    cache.disk.close()


def test_a_restart_rebuilds_the_tree_without_reading_a_block(tmp_path: Path) -> None:
    cache = make_tiered_cache(tmp_path, num_blocks=8, block_size=BS)
    put(cache, A)
    meta = json.loads(json.dumps(export_index(cache)))
    assert cache.disk is not None
    cache.disk.close()
    fresh = make_tiered_cache(tmp_path, num_blocks=8, block_size=BS)
    import_index(fresh, meta)
    fresh.check_integrity()
    assert fresh.manager.num_free == 8 and fresh.peek(A) == len(A)
    hit = look(fresh, A + [5])
    assert hit.source is HitSource.DISK and hit.matched == len(A)
    assert fresh.disk is not None
    fresh.disk.close()


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_a_damaged_block_file_is_never_served(tmp_path: Path, damage: str) -> None:
    cache = make_tiered_cache(tmp_path, num_blocks=8, block_size=BS)
    put(cache, A)
    cache.evict(8)
    assert cache.disk is not None
    cache.disk.flush()
    second = cache.tree.find_prefix(A).disk[1].key
    path = block_path(tmp_path, second)
    data = bytearray(path.read_bytes())
    if damage == "corrupt":
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:100]))
    else:
        path.unlink()
    hit = look(cache, A + [99])
    assert hit.matched == BS  # the first block only: the damaged one and all after it went
    assert cache.peek(A) == BS
    notices = cache.take_notices()
    if damage != "delete":
        assert any(second[:12] in n for n in notices)
    assert cache.stats().disk_failures == 1
    put(cache, A)  # recomputed and cached again, correctly
    assert look(cache, A + [99]).matched == len(A)
    cache.disk.close()


def test_the_disk_budget_is_respected(tmp_path: Path) -> None:
    probe = make_tiered_cache(tmp_path / "probe", num_blocks=4, block_size=BS)
    assert probe.disk is not None
    per_block = probe.disk.layout.payload_bytes
    probe.disk.close()
    cache = make_tiered_cache(tmp_path / "s", num_blocks=4, block_size=BS,
                              budget_bytes=3 * (per_block + 1024))
    for start in range(0, 80, 16):
        put(cache, list(range(start + 100, start + 116)))
    assert cache.disk is not None
    cache.disk.flush()
    stats = cache.disk.stats()
    assert stats.bytes <= stats.budget_bytes and stats.evictions > 0
    export_index(cache)  # prunes blocks whose files the budget removed
    cache.check_integrity()
    for node, _ in cache.tree.nodes():
        for key in node.keys[len(node.blocks):]:
            assert cache.disk.contains(key)
    cache.disk.close()


def test_clear_forgets_both_tiers(tmp_path: Path) -> None:
    cache = make_tiered_cache(tmp_path, num_blocks=8, block_size=BS)
    put(cache, A)
    cache.evict(2)
    cache.clear()
    cache.check_integrity()
    assert cache.peek(A) == 0 and list(cache.tree.nodes()) == []
    assert cache.disk is not None
    cache.disk.close()
