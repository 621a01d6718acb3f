"""The cache's state as plain data, through its owners' public methods: the pool exports and
imports blocks (and gives them back when an import fails), the cache resets, and policies save
and restore their state. (The saved index and the disk tier: tests/test_disk_tier.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from _cache_helpers import assert_kv_equal, fetch, make_cache, make_manager, ref_kv, store

from kvchat.cache.eviction import make_policy
from kvchat.cache.kvcache import PagedKVCache

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


def test_reset_frees_everything_even_held_blocks() -> None:
    cache = filled()
    cache.lookup(A)  # held, never released
    cache.reset()
    cache.check_integrity()
    assert cache.manager.num_free == 16 and cache.stats() == make_cache(16, BS).stats()




def test_block_manager_exports_and_imports_blocks() -> None:
    src = make_manager(num_blocks=6, block_size=BS)
    blocks = src.allocate(2)
    src.write([b.block_id for b in blocks], 0, ref_kv(A[:7]))
    blocks[1].last_accessed, blocks[1].attn_score = 5, 0.25
    kv = src.export_blocks([b.block_id for b in blocks])
    assert [tuple(k.shape) for k, _ in kv] == [(2, 2, BS, 4)] * 2

    dst = make_manager(num_blocks=6, block_size=BS)
    dst.allocate(3)  # the imported blocks land elsewhere in the pool
    got = dst.import_blocks([b.record() for b in blocks], kv)
    assert [b.ref_count for b in got] == [0, 0]
    assert [b.node for b in got] == [None, None]  # their tokens come with the tree's node
    assert (got[1].last_accessed, got[1].attn_score) == (5, 0.25)
    assert_kv_equal(dst.gather([b.block_id for b in got], 7), ref_kv(A[:7]))


def test_a_failed_import_gives_its_blocks_back() -> None:
    m = make_manager(num_blocks=6, block_size=BS)
    with pytest.raises(KeyError):
        m.import_blocks([{"attn_score": 0.0}, {}], make_manager().export_blocks([0, 1]))
    with pytest.raises(RuntimeError):  # K/V for two blocks, one record
        m.import_blocks([{"last_accessed": 0, "attn_score": 0.0}],
                        make_manager().export_blocks([0, 1]))
    assert m.num_free == 6 and all(b.ref_count == 0 for b in m.blocks)


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
