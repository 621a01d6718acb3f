"""ExactIndex: whole prompt -> blocks and last-position logits, bounded, dying with its blocks."""

from __future__ import annotations

import pytest
import torch
from _cache_helpers import in_node

from kvchat.cache.blocks import Block
from kvchat.cache.exact import ExactIndex

BS = 4


def blocks_for(tokens: list[int], first_id: int) -> list[Block]:
    """Blocks holding `tokens`, as one tree node would."""
    out = [Block(first_id + i // BS, BS) for i in range(0, len(tokens), BS)]
    in_node(out, tokens)
    return out


def test_put_get_with_and_without_logits() -> None:
    idx = ExactIndex()
    toks = [1, 2, 3, 4, 5]
    blocks = blocks_for(toks, 0)
    row = torch.arange(10, dtype=torch.float32)
    idx.put(toks, blocks, row)
    entry = idx.get(toks)
    assert entry is not None
    assert entry.blocks == blocks and entry.logits is row
    assert tuple(toks) in idx and len(idx) == 1
    assert idx.get([1, 2, 3, 4]) is None  # exact only: a prefix is not a hit
    assert idx.get([1, 2, 3, 4, 5, 6]) is None
    idx.put([7], blocks_for([7], 10))
    entry = idx.get([7])
    assert entry is not None and entry.logits is None
    idx.check(BS)


def test_put_same_key_replaces_the_entry_and_its_reverse_map() -> None:
    idx = ExactIndex()
    toks = [1, 2, 3, 4, 5]
    old, new = blocks_for(toks, 0), blocks_for(toks, 20)
    idx.put(toks, old, torch.zeros(3))
    idx.put(toks, new, torch.ones(3))
    entry = idx.get(toks)
    assert entry is not None and entry.blocks == new and torch.equal(entry.logits, torch.ones(3))
    assert len(idx) == 1
    assert idx.drop_block(old[0]) == 0  # the old blocks no longer point at the key
    assert idx.drop_block(new[1]) == 1 and len(idx) == 0
    idx.check(BS)


def test_max_entries_drops_the_oldest() -> None:
    idx = ExactIndex(max_entries=2)
    seqs = [[1], [2], [3]]
    for i, s in enumerate(seqs):
        idx.put(s, blocks_for(s, i))
    assert [k for k, _ in idx.items()] == [(2,), (3,)]
    idx.check(BS)


def test_get_refreshes_an_entry_so_the_least_recently_used_goes_first() -> None:
    idx = ExactIndex(max_entries=2)
    idx.put([1], blocks_for([1], 0))
    idx.put([2], blocks_for([2], 1))
    assert idx.get([1]) is not None
    idx.put([3], blocks_for([3], 2))
    assert [k for k, _ in idx.items()] == [(1,), (3,)]
    # the dropped entry's reverse map went with it
    assert idx.drop_block(Block(1, BS)) == 0
    idx.check(BS)


def test_zero_entries_disables_the_index() -> None:
    idx = ExactIndex(max_entries=0)
    idx.put([1, 2], blocks_for([1, 2], 0), torch.zeros(2))
    assert len(idx) == 0 and idx.get([1, 2]) is None


def test_drop_block_removes_every_entry_reading_it() -> None:
    idx = ExactIndex()
    shared = blocks_for([1, 2, 3, 4], 0)[0]
    a_tail = blocks_for([5, 6], 1)[0]
    b_tail = blocks_for([7], 2)[0]
    idx.put([1, 2, 3, 4, 5, 6], [shared, a_tail])
    idx.put([1, 2, 3, 4, 7], [shared, b_tail])
    idx.put([1, 2, 3], [shared])
    other = blocks_for([9, 9], 3)
    idx.put([9, 9], other)
    assert idx.drop_block(a_tail) == 1
    assert sorted(k for k, _ in idx.items()) == [(1, 2, 3), (1, 2, 3, 4, 7), (9, 9)]
    assert idx.drop_block(shared) == 2
    assert [k for k, _ in idx.items()] == [(9, 9)]
    assert idx.drop_block(shared) == 0
    assert idx.drop_block(b_tail) == 0  # its only entry already went with `shared`
    idx.check(BS)


def test_clear() -> None:
    idx = ExactIndex()
    idx.put([1], blocks_for([1], 0))
    idx.clear()
    assert len(idx) == 0 and list(idx.items()) == [] and idx.drop_block(Block(0, BS)) == 0


def test_check_catches_an_entry_whose_blocks_changed() -> None:
    idx = ExactIndex()
    blocks = blocks_for([1, 2, 3, 4, 5], 0)
    idx.put([1, 2, 3, 4, 5], blocks)
    idx.check(BS)
    node = blocks[1].node
    assert node is not None
    node.tokens[4:] = [6]  # the edge holding the entry's last block now ends otherwise
    with pytest.raises(AssertionError, match="no longer hold"):
        idx.check(BS)


def test_check_catches_a_wrong_block_count() -> None:
    idx = ExactIndex()
    blocks = blocks_for([1, 2, 3, 4, 5], 0)
    idx.put([1, 2, 3, 4, 5], blocks[:1])
    with pytest.raises(AssertionError, match="block count"):
        idx.check(BS)


def test_check_catches_a_stale_reverse_map() -> None:
    idx = ExactIndex()
    blocks = blocks_for([1, 2], 0)
    idx.put([1, 2], blocks)
    idx._by_block.setdefault(7, set()).add(("", (4, 4)))  # a key with no entry
    with pytest.raises(AssertionError):
        idx.check(BS)
    idx = ExactIndex()
    idx.put([1, 2], blocks)
    idx._by_block[blocks[0].block_id].discard(("", (1, 2)))  # an entry its block forgot
    with pytest.raises(AssertionError, match="reverse map"):
        idx.check(BS)


class CountingInt(int):
    """A token that counts how often it is hashed."""

    hashes = 0

    def __hash__(self) -> int:
        CountingInt.hashes += 1
        return int.__hash__(self)


def test_a_long_prompt_is_hashed_a_constant_number_of_times_not_once_per_block() -> None:
    # The reverse map holds the key once per block; re-hashing all n tokens for each of the
    # n / block_size blocks made put and eviction quadratic in the prompt length.
    n = 256
    toks = [CountingInt(i) for i in range(n)]
    blocks = blocks_for(toks, 0)  # 64 blocks
    idx = ExactIndex()
    CountingInt.hashes = 0
    idx.put(toks, blocks, torch.zeros(1))
    assert CountingInt.hashes <= 2 * n
    assert idx.get(toks) is not None
    CountingInt.hashes = 0
    assert idx.drop_block(blocks[10]) == 1
    assert CountingInt.hashes <= 2 * n
    assert len(idx) == 0
    idx.check(BS)
