"""Tombstones: the bounded memory of evicted blocks that `explain` reads."""

from __future__ import annotations

from kvchat.cache.block_keys import next_key
from kvchat.cache.radix import RadixTree
from kvchat.cache.tombstones import Tombstones

BS = 4


def chain(tree: RadixTree, tokens: list[int], namespace: str = "") -> list[tuple[str, str]]:
    """(key, key before) of each block of `tokens`, as the tree chains them."""
    out, prev = [], tree.root_key(namespace)
    for lo in range(0, len(tokens), BS):
        key = next_key(prev, tokens[lo : lo + BS])
        out.append((key, prev))
        prev = key
    return out


def test_longest_follows_the_prompts_own_chain_through_evicted_blocks() -> None:
    tree, dead = RadixTree(BS), Tombstones()
    tokens = list(range(1, 13))
    for i, (key, prev) in enumerate(chain(tree, tokens)):
        dead.record(key, prev, tokens[i * BS : (i + 1) * BS], "lru", when=100.0 + i)
    # runs through the first two blocks and parts from the third inside it: that block counts
    assert dead.longest(tree, "", tokens[:10] + [99, 99], 0) == (10, 102.0, "lru")
    assert dead.longest(tree, "", tokens[:10], 10) is None  # nothing past what is cached
    assert dead.longest(tree, "other", tokens, 0) is None  # another namespace's chain
    assert dead.longest(tree, "", [7] + tokens[1:], 0) is None  # differs in block one


def test_capacity_forgets_the_oldest_and_re_recording_makes_one_newest() -> None:
    tree, dead = RadixTree(BS), Tombstones(capacity=2)
    blocks = [[10 * k + i for i in range(BS)] for k in range(3)]
    keys = [chain(tree, b)[0] for b in blocks]
    dead.record(*keys[0], blocks[0], "lru", 1.0)
    dead.record(*keys[1], blocks[1], "lru", 2.0)
    dead.record(*keys[0], blocks[0], "h2o", 3.0)  # again: now the newest
    dead.record(*keys[2], blocks[2], "lru", 4.0)  # over capacity: block 1 goes
    assert len(dead) == 2
    assert [row[0] for row in dead.rows()] == [keys[0][0], keys[2][0]]
    assert dead.longest(tree, "", blocks[1] + [0], 0) is None
    assert dead.longest(tree, "", blocks[0] + [0], 0) == (4, 3.0, "h2o")


def test_rows_round_trip_through_json() -> None:
    tree, dead = RadixTree(BS), Tombstones(capacity=8)
    for k in range(3):
        b = [k, k + 1, k + 2, k + 3]
        dead.record(*chain(tree, b)[0], b, "clear", float(k))
    again = Tombstones.from_json(dead.to_json(), capacity=8)
    assert again.rows() == dead.rows() and len(again) == 3
