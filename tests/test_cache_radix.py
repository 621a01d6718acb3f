"""RadixTree: token-granular longest-prefix matches over block-granular nodes."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchat.cache import radix
from kvchat.cache.blocks import Block
from kvchat.cache.radix import RadixTree

REPO = Path(__file__).resolve().parent.parent


class Pool:
    """Hands out fresh Block handles; the tree needs nothing else from a pool."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._ids = itertools.count()

    def new(self, n: int) -> list[Block]:
        return [Block(next(self._ids), self.block_size) for _ in range(n)]


def cache_store(tree: RadixTree, pool: Pool, tokens: Sequence[int]) -> list[Block]:
    """The facade's protocol for an insert: reuse the matched blocks, extend a leaf ending
    mid-block in place, otherwise branch at the last block boundary with fresh blocks."""
    bs = tree.block_size
    match = tree.find_prefix(tokens)
    m, n = match.matched, len(tokens)
    if match.at_leaf_end and m % bs:
        blocks = match.blocks + pool.new(-(-(n - m - (bs - m % bs)) // bs) if n > m else 0)
        blocks = blocks[: -(-n // bs)]
    else:
        base = m // bs * bs
        blocks = match.blocks[: base // bs] + pool.new(-(-(n - base) // bs))
    tree.insert(tokens, blocks)
    tree.check_integrity()
    return blocks


def ids(blocks: Sequence[Block]) -> list[int]:
    return [b.block_id for b in blocks]


def shape(tree: RadixTree) -> list[tuple[int, int, int, int]]:
    """(depth, start, end, number of blocks) per node, depth first."""
    return [(d, n.start, n.end, len(n.blocks)) for n, d in tree.nodes()]


# ---- find_prefix -----------------------------------------------------------------------------


def test_empty_tree_and_empty_query() -> None:
    tree = RadixTree(4)
    m = tree.find_prefix([1, 2, 3])
    assert (m.matched, m.blocks, m.node, m.at_leaf_end) == (0, [], None, False)
    pool = Pool(4)
    cache_store(tree, pool, [1, 2, 3])
    assert tree.find_prefix([]).matched == 0
    assert tree.find_prefix([7]).matched == 0


def test_find_prefix_is_the_longest_match_in_tokens() -> None:
    tree, pool = RadixTree(4), Pool(4)
    a = cache_store(tree, pool, list(range(10)))
    for q, want in [
        (list(range(10)), 10),
        (list(range(12)), 10),  # runs past the cached sequence
        (list(range(7)), 7),  # shorter than the edge: ends mid-edge, mid-block
        ([0, 1, 2, 3, 4, 99], 5),
        ([0, 99], 1),
        ([99], 0),
    ]:
        m = tree.find_prefix(q)
        assert m.matched == want, q
        assert ids(m.blocks) == ids(a[: -(-want // 4)])
    assert tree.find_prefix(list(range(10))).at_leaf_end
    assert not tree.find_prefix(list(range(7))).at_leaf_end


def test_47_shared_tokens_with_block_size_64_share_47() -> None:
    tree, pool = RadixTree(64), Pool(64)
    a_tokens = list(range(100))
    b_tokens = list(range(47)) + [1000 + i for i in range(53)]
    a = cache_store(tree, pool, a_tokens)
    m = tree.find_prefix(b_tokens)
    assert m.matched == 47
    assert ids(m.blocks) == [a[0].block_id]
    b = cache_store(tree, pool, b_tokens)
    assert b[0] is not a[0]  # diverging inside block 0: the branch owns a copy of that block
    assert b[0].token_ids == b_tokens[:64] and a[0].token_ids == a_tokens[:64]
    for tokens, blocks in [(a_tokens, a), (b_tokens, b)]:
        m = tree.find_prefix(tokens)
        assert m.matched == 100 and ids(m.blocks) == ids(blocks)
    # two siblings at the root, both starting at 0, sharing 47 leading tokens
    assert shape(tree) == [(1, 0, 100, 2), (1, 0, 100, 2)]
    assert b[0].is_first_block and a[0].is_first_block


def test_mid_block_divergence_splits_at_the_block_boundary() -> None:
    tree, pool = RadixTree(4), Pool(4)
    a_tokens = list(range(12))
    a = cache_store(tree, pool, a_tokens)
    b_tokens = list(range(9)) + [50, 51, 52, 53]  # diverges at 9, inside block 2 = [8, 12)
    b = cache_store(tree, pool, b_tokens)
    # upper node [0, 8) keeps a's first two blocks; both branches start at 8
    assert shape(tree) == [(1, 0, 8, 2), (2, 8, 12, 1), (2, 8, 13, 2)]
    assert ids(b[:2]) == ids(a[:2])
    assert b[2] is not a[2] and b[2].token_ids == [8, 50, 51, 52] and b[3].token_ids == [53]
    assert a[2].token_ids == [8, 9, 10, 11]
    assert tree.find_prefix(b_tokens).matched == 13
    assert tree.find_prefix(a_tokens).matched == 12
    assert tree.find_prefix(list(range(9)) + [77]).matched == 9


def test_divergence_on_a_block_boundary_shares_whole_blocks() -> None:
    tree, pool = RadixTree(4), Pool(4)
    a = cache_store(tree, pool, list(range(12)))
    b = cache_store(tree, pool, list(range(8)) + [60, 61])
    assert shape(tree) == [(1, 0, 8, 2), (2, 8, 12, 1), (2, 8, 10, 1)]
    assert ids(b[:2]) == ids(a[:2]) and len(b) == 3


def test_leaf_ending_mid_block_is_extended_in_place() -> None:
    tree, pool = RadixTree(4), Pool(4)
    a = cache_store(tree, pool, list(range(6)))
    assert a[1].token_ids == [4, 5]
    b = cache_store(tree, pool, list(range(10)))
    assert ids(b[:2]) == ids(a)  # the half-full block is filled, not copied
    assert a[1].token_ids == [4, 5, 6, 7] and b[2].token_ids == [8, 9]
    assert shape(tree) == [(1, 0, 10, 3)]
    assert len(list(tree.leaves())) == 1


def test_extension_must_reuse_the_leafs_last_block() -> None:
    tree, pool = RadixTree(4), Pool(4)
    a = cache_store(tree, pool, list(range(6)))
    with pytest.raises(AssertionError, match="reuse"):
        tree.insert(list(range(8)), [a[0], *pool.new(1)])


def test_leaf_ending_on_a_boundary_grows_in_place() -> None:
    tree, pool = RadixTree(4), Pool(4)
    a = cache_store(tree, pool, list(range(8)))
    b = cache_store(tree, pool, list(range(11)))
    assert ids(b[:2]) == ids(a)
    assert shape(tree) == [(1, 0, 11, 3)]


def test_inserting_a_cached_prefix_changes_nothing() -> None:
    tree, pool = RadixTree(4), Pool(4)
    a = cache_store(tree, pool, list(range(10)))
    tree.insert(list(range(5)), a[:2])
    tree.check_integrity()
    assert shape(tree) == [(1, 0, 10, 3)]
    assert a[1].token_ids == [4, 5, 6, 7]


def test_insert_checks_the_block_count() -> None:
    tree, pool = RadixTree(4), Pool(4)
    with pytest.raises(ValueError, match="need 3 blocks"):
        tree.insert(list(range(9)), pool.new(2))


def test_insert_records_owners() -> None:
    tree, pool = RadixTree(4), Pool(4)
    tree.insert(list(range(8)), pool.new(2), owner="alice")
    m = tree.find_prefix(list(range(4)))
    blocks = m.blocks + pool.new(1)
    tree.insert(list(range(4)) + [9, 9, 9, 9], blocks, owner="bob")
    top = next(n for n, d in tree.nodes() if d == 1)
    assert top.owners == {"alice", "bob"}
    assert sorted(sorted(c.owners) for c in top.child_list()) == [["alice"], ["bob"]]
    # carol diverges inside block 0: a sibling of [0, 4), sharing its head but not its path
    m = tree.find_prefix([0, 1, 5])
    tree.insert([0, 1, 5], pool.new(1), owner="carol")
    tree.insert([0, 1, 2], m.blocks, owner="dave")  # ends inside [0, 4): dave reads it
    tree.check_integrity()
    roots = sorted((sorted(n.owners), n.tokens) for n, d in tree.nodes() if d == 1)
    assert roots == [(["alice", "bob", "dave"], [0, 1, 2, 3]), (["carol"], [0, 1, 5])]


# ---- iteration -------------------------------------------------------------------------------


def test_nodes_are_depth_first_in_insertion_order_and_leaves_match() -> None:
    tree, pool = RadixTree(2), Pool(2)
    cache_store(tree, pool, [1, 2, 3, 4, 5, 6])
    cache_store(tree, pool, [1, 2, 3, 4, 7, 8])
    cache_store(tree, pool, [1, 2, 9, 9])
    cache_store(tree, pool, [5, 5])
    got = [(d, n.tokens) for n, d in tree.nodes()]
    assert got == [
        (1, [1, 2]),
        (2, [3, 4]),
        (3, [5, 6]),
        (3, [7, 8]),
        (2, [9, 9]),
        (1, [5, 5]),
    ]
    assert sorted(n.tokens for n in tree.leaves()) == [[5, 5], [5, 6], [7, 8], [9, 9]]
    assert tree.num_tokens == 12
    assert len(list(tree.all_blocks())) == 6


# ---- removal ---------------------------------------------------------------------------------


def test_pop_block_trims_and_removes_the_leaf_and_merges_the_parent() -> None:
    tree, pool = RadixTree(4), Pool(4)
    a = cache_store(tree, pool, list(range(12)))
    b = cache_store(tree, pool, list(range(8)) + [40, 41, 42, 43, 44])
    leaf_b = next(n for n in tree.leaves() if n.tokens[0] == 40)
    assert tree.pop_block(leaf_b) is b[3]
    tree.check_integrity()
    assert leaf_b.tokens == [40, 41, 42, 43]
    assert tree.pop_block(leaf_b) is b[2]
    tree.check_integrity()
    # [0, 8) was left with one child: merged back into a single edge
    assert shape(tree) == [(1, 0, 12, 3)]
    assert tree.find_prefix(list(range(12))).matched == 12
    assert ids(tree.find_prefix(list(range(12))).blocks) == ids(a)
    assert tree.find_prefix(list(range(8)) + [40]).matched == 8


def test_pop_block_of_an_only_child_makes_the_parent_a_leaf() -> None:
    tree, pool = RadixTree(4), Pool(4)
    cache_store(tree, pool, list(range(8)))
    cache_store(tree, pool, list(range(4)) + [9, 9])
    leaf = next(n for n in tree.leaves() if n.tokens[0] == 9)
    tree.pop_block(leaf)
    tree.check_integrity()
    leaf = next(n for n in tree.leaves())
    tree.pop_block(leaf)  # the other branch: [0, 4) is now a leaf
    tree.check_integrity()
    assert shape(tree) == [(1, 0, 4, 1)]
    assert [n.tokens for n in tree.leaves()] == [[0, 1, 2, 3]]


def test_pop_block_rejects_inner_nodes() -> None:
    tree, pool = RadixTree(4), Pool(4)
    cache_store(tree, pool, list(range(8)))
    cache_store(tree, pool, list(range(4)) + [9])
    inner = next(n for n, d in tree.nodes() if d == 1)
    with pytest.raises(ValueError, match="last resident block"):
        tree.pop_block(inner)
    with pytest.raises(ValueError):
        tree.pop_block(tree.root)


def test_spilled_blocks_stay_matched_on_disk_and_truncate_drops_them() -> None:
    tree, pool = RadixTree(4), Pool(4)
    a = cache_store(tree, pool, list(range(10)))
    b = cache_store(tree, pool, list(range(4)) + [7, 7, 7])
    leaf_b = tree.find_prefix(list(range(4)) + [7]).node
    assert leaf_b is not None
    assert tree.spill_block(leaf_b) is b[1]
    tree.check_integrity()
    match = tree.find_prefix(list(range(4)) + [7, 7, 7, 9])
    assert match.matched == 7 and ids(match.blocks) == [a[0].block_id]
    assert [(d.node, d.nth) for d in match.disk] == [(leaf_b, 0)]
    assert match.resident(4) == 4
    with pytest.raises(ValueError, match="last resident"):
        tree.spill_block(tree.find_prefix(list(range(4))).node)  # a resident child below
    fresh = pool.new(1)[0]
    tree.attach_block(leaf_b, fresh)
    tree.check_integrity()
    assert fresh.token_ids == [7, 7, 7] and not tree.find_prefix([0, 1, 2, 3, 7]).disk
    tree.spill_block(leaf_b)
    assert tree.drop_disk() == 1
    tree.check_integrity()
    assert shape(tree) == [(1, 0, 10, 3)]


def _assert_blocks_read_their_edges(tree: RadixTree) -> None:
    bs = tree.block_size
    for node, _ in tree.nodes():
        for i, block in enumerate(node.blocks):
            assert block.node is node and block.index == i
            assert block.token_ids == node.tokens[i * bs : (i + 1) * bs]
            assert block.is_first_block == (node.start == 0 and i == 0)


def test_blocks_read_the_tree_tokens_through_split_merge_spill_and_attach() -> None:
    tree, pool = RadixTree(4), Pool(4)
    a = cache_store(tree, pool, list(range(12)))
    b = cache_store(tree, pool, list(range(9)) + [50, 51])  # splits a's edge at 8
    _assert_blocks_read_their_edges(tree)
    upper = a[0].node
    assert upper is not None and upper is a[1].node and upper.tokens == list(range(8))
    assert a[2].node is not upper and a[2].index == 0 and a[2].token_ids == [8, 9, 10, 11]
    assert [blk.is_first_block for blk in a] == [True, False, False]
    assert b[2].token_ids == [8, 50, 51] and not b[2].is_first_block
    leaf_b = b[2].node
    assert leaf_b is not None
    assert tree.pop_block(leaf_b) is b[2]  # [0, 8) keeps one child: merged back into one edge
    assert tree.merges == 1 and (b[2].node, b[2].token_ids) == (None, [])
    tree.check_integrity()
    _assert_blocks_read_their_edges(tree)
    assert a[2].node is upper and a[2].index == 2 and a[2].token_ids == [8, 9, 10, 11]
    assert tree.spill_block(upper) is a[2]
    assert (a[2].node, a[2].token_ids, a[2].num_tokens) == (None, [], 0)
    tree.check_integrity()
    fresh = pool.new(1)[0]
    tree.attach_block(upper, fresh)
    tree.check_integrity()
    _assert_blocks_read_their_edges(tree)
    assert (fresh.node, fresh.index, fresh.token_ids) == (upper, 2, [8, 9, 10, 11])


def test_check_catches_a_resident_block_below_one_on_disk() -> None:
    tree, pool = RadixTree(4), Pool(4)
    cache_store(tree, pool, list(range(10)))
    cache_store(tree, pool, list(range(4)) + [7, 7, 7])
    upper = tree.find_prefix(list(range(4))).node
    assert upper is not None
    upper.blocks.pop()
    with pytest.raises(AssertionError, match="resident below on-disk"):
        tree.check_integrity()


def test_clear_empties_the_tree() -> None:
    tree, pool = RadixTree(4), Pool(4)
    cache_store(tree, pool, list(range(10)))
    tree.clear()
    tree.check_integrity()
    assert list(tree.nodes()) == [] and tree.find_prefix(list(range(10))).matched == 0


# ---- check() can fail ------------------------------------------------------------------------


def _two_branch_tree() -> tuple[RadixTree, list[Block], list[Block]]:
    tree, pool = RadixTree(4), Pool(4)
    a = cache_store(tree, pool, list(range(12)))
    b = cache_store(tree, pool, list(range(9)) + [50, 51])
    return tree, a, b


def test_check_catches_a_block_pointing_at_another_place_of_its_node() -> None:
    tree, a, _ = _two_branch_tree()
    a[2].index = 1  # would read the tokens of the block before it
    with pytest.raises(AssertionError, match="point back"):
        tree.check_integrity()


def test_check_catches_a_block_in_two_nodes() -> None:
    tree, a, b = _two_branch_tree()
    leaf_b = next(n for n in tree.leaves() if n.blocks[0] is b[2])
    leaf_b.blocks[0] = a[2]
    with pytest.raises(AssertionError):
        tree.check_integrity()


def test_check_catches_a_mid_block_start() -> None:
    tree, _, _ = _two_branch_tree()
    leaf = next(iter(tree.leaves()))
    leaf.start += 1
    with pytest.raises(AssertionError, match="mid-block"):
        tree.check_integrity()


def test_check_catches_a_stale_leaf_set() -> None:
    tree, _, _ = _two_branch_tree()
    tree._leaves.pop()
    with pytest.raises(AssertionError, match="leaf set"):
        tree.check_integrity()


def test_check_catches_a_block_pointing_at_another_node() -> None:
    tree, a, _ = _two_branch_tree()
    a[1].node = a[2].node  # would read (and call itself first of) another edge
    with pytest.raises(AssertionError, match="point back"):
        tree.check_integrity()


def test_check_catches_missing_blocks() -> None:
    tree, _, _ = _two_branch_tree()
    leaf = next(iter(tree.leaves()))
    leaf.keys.pop()
    with pytest.raises(AssertionError, match="cover"):
        tree.check_integrity()


# ---- cost --------------------------------------------------------------------------------------


def test_lookup_does_not_scan_every_session_that_shares_a_block_head(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A 47-token system prompt with block size 16: every conversation branches inside block 2,
    # so all of them are siblings sharing its first 15 tokens. A lookup must not compare the
    # prompt against each of them, or its cost grows with the number of sessions cached.
    tree, pool = RadixTree(16), Pool(16)
    system = list(range(47))
    for i in range(300):
        cache_store(tree, pool, [*system, 1000 + i, 5000 + i])
    calls = 0
    real = radix.common_prefix

    def counting(a: Sequence[int], b: Sequence[int], b_from: int) -> int:
        nonlocal calls
        calls += 1
        return real(a, b, b_from)

    monkeypatch.setattr(radix, "common_prefix", counting)
    for query, want in [
        ([*system, 999, 1], 47),
        ([*system, 1150, 5150, 3], 49),
        ([*system, 1150, 7], 48),
        (system[:40], 40),
    ]:
        calls = 0
        assert tree.find_prefix(query).matched == want
        assert calls <= 2 * 2  # at most two candidates at each of the two nodes on the path


def test_siblings_are_kept_in_token_order() -> None:
    tree, pool = RadixTree(4), Pool(4)
    for tokens in ([1, 2, 3, 5, 6], [1, 2, 3, 4, 6], [1, 2, 8], [1, 2, 9, 9, 9], [1, 0]):
        cache_store(tree, pool, tokens)
    (group,) = tree.root.children.values()
    assert [c.tokens for c in group] == [[1, 0], [1, 2, 3, 4, 6], [1, 2, 3, 5, 6], [1, 2, 8],
                                         [1, 2, 9, 9, 9]]
    for q, want in [([1, 2, 9, 9, 9, 0], 5), ([1, 2, 3, 4, 6], 5), ([1, 2, 3, 5, 0], 4),
                     ([1, 2, 3, 0], 3), ([1, 2, 7], 2), ([1, 1], 1)]:
        assert tree.find_prefix(q).matched == want, q


def test_check_catches_siblings_out_of_order() -> None:
    tree, pool = RadixTree(4), Pool(4)
    cache_store(tree, pool, [1, 2, 3, 4])
    cache_store(tree, pool, [1, 2, 5, 5])
    tree.root.children[1].reverse()
    with pytest.raises(AssertionError, match="order"):
        tree.check_integrity()


# ---- properties ------------------------------------------------------------------------------


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 5),
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14), min_size=1, max_size=8),
    st.lists(st.integers(0, 2), max_size=16),
)
def test_find_prefix_equals_the_longest_common_prefix_with_anything_stored(
    bs: int, seqs: list[list[int]], query: list[int]
) -> None:
    tree, pool = RadixTree(bs), Pool(bs)
    stored: list[list[int]] = []
    for s in seqs:
        cache_store(tree, pool, s)
        stored.append(s)
        for probe in [*stored, query]:
            m = tree.find_prefix(probe)
            assert m.matched == max(_lcp(probe, t) for t in stored)
            covered = [t for b in m.blocks for t in b.token_ids][: m.matched]
            assert covered == probe[: m.matched]
            assert len(m.blocks) == -(-m.matched // bs)


# ---- import weight ---------------------------------------------------------------------------


def test_bookkeeping_modules_do_not_import_torch() -> None:
    code = (
        "import sys, kvchat.cache.radix, kvchat.cache.exact, kvchat.cache.eviction, kvchat.config;"
        " assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
