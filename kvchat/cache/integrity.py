"""The cache's consistency check: pool, radix tree and exact index agree (tests call it after
every operation; a failure is a bug, never a user error)."""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvchat.cache.kvcache import PagedKVCache
    from kvchat.cache.radix import RadixTree


def check_cache(cache: PagedKVCache) -> None:
    """Raise AssertionError naming the first disagreement found."""
    cache.tree.check()
    cache.exact.check(cache.block_size)
    mgr = cache.manager
    free_list = list(mgr.free_ids)
    free = set(free_list)
    assert len(free_list) == len(free), "duplicate ids in the free list"
    # block id -> the namespace of the node holding it
    in_tree = {b.block_id: node.namespace for node, _ in cache.tree.nodes()
               for b in node.blocks}
    for block in mgr.blocks:
        bid = block.block_id
        assert block.ref_count >= 0, f"negative ref count on {block!r}"
        if mgr.is_free(bid):
            assert bid in free, f"block {bid} marked free but not in free list"
            assert bid not in in_tree, f"block {bid} both free and in the tree"
            assert block.ref_count == 0, f"free block {bid} is referenced"
        else:
            assert bid in in_tree, f"block {bid} allocated but owned by nothing"
    assert len(free) + len(in_tree) == mgr.num_blocks, "free + used != total"
    if cache.disk is None:
        assert not any(n.on_disk for n, _ in cache.tree.nodes()), "blocks on disk, no tier"
    for pin in cache.pins:
        for bid in pin.block_ids:
            assert in_tree.get(bid) == pin.namespace, (
                f"pin {pin.pin_id} holds block {bid}, which its namespace's tree lacks")
    assert len(cache.pins.block_ids) <= cache.pins.cap, "more blocks pinned than the cap"
    for _, entry in cache.exact.items():
        for block in entry.blocks:
            assert block.block_id in in_tree, "exact entry points at an evicted block"
            assert in_tree[block.block_id] == entry.namespace, (
                f"exact entry of namespace {entry.namespace!r} reads a block of "
                f"{in_tree[block.block_id]!r}")


def check_tree(tree: RadixTree) -> None:
    """The radix tree's structural invariants (listed in its module docstring)."""
    bs = tree.block_size
    seen: set[int] = set()
    leaves = set()
    for node, _ in tree.nodes():
        assert node.tokens, "empty non-root node"
        assert node.start % bs == 0, f"node starts mid-block at {node.start}"
        assert node.parent is not None
        assert node.namespace == node.parent.namespace, "node outside its parent's namespace"
        expected_start = node.parent.end if not node.parent.is_root else 0
        assert node.start == expected_start, "child does not start where its parent ends"
        assert len(node.keys) == -(-len(node.tokens) // bs), "keys do not cover the edge"
        assert len(node.blocks) <= len(node.keys), "more blocks than keys"
        if node.on_disk:
            assert not any(c.blocks for c in node.child_list()), "resident below on-disk"
        joined: list[int] = []
        for i, block in enumerate(node.blocks):
            assert block.block_id not in seen, f"block {block.block_id} in two nodes"
            seen.add(block.block_id)
            assert block.ref_count >= 0
            assert block.is_first_block == (node.start == 0 and i == 0), "first-block flag"
            joined.extend(block.token_ids)
        assert joined == node.tokens[: len(joined)], "block tokens disagree with the edge"
        if len(node.blocks) == len(node.keys):
            assert len(joined) == len(node.tokens), "resident blocks do not cover the edge"
        else:
            assert len(joined) == len(node.blocks) * bs, "a partial block before disk"
        if node.children:
            assert node.end % bs == 0, "inner node ends mid-block"
            for key, group in node.children.items():
                assert group and all(c.tokens[0] == key for c in group)
                assert all(a.tokens < b.tokens for a, b in pairwise(group)), "order"
        else:
            leaves.add(node)
    assert "" in tree.roots, "namespace \"\" has no root"
    for namespace, root in tree.roots.items():
        assert root.is_root and root.namespace == namespace, "root of another namespace"
        assert not root.tokens and not root.blocks, "a root holds tokens"
        assert root.children or not namespace, f"empty namespace {namespace!r} kept"
        for key, group in root.children.items():
            assert group and all(c.tokens[0] == key for c in group)
            assert all(a.tokens < b.tokens for a, b in pairwise(group)), "order"
    assert leaves == set(tree.leaves()), "leaf set out of date"
