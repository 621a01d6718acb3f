"""The cache's consistency check across its parts: pool, radix tree, exact index and pins agree
(tests call it after every operation; a failure is a bug, never a user error). Each part checks
its own invariants (`RadixTree.check_integrity`, `ExactIndex.check`); this checks how they fit."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvchat.cache.blocks import BlockManager
    from kvchat.cache.exact import ExactIndex
    from kvchat.cache.pins import PinTable
    from kvchat.cache.radix import RadixTree


def check_cache(mgr: BlockManager, tree: RadixTree, exact: ExactIndex, pins: PinTable,
                has_disk: bool) -> None:
    """Raise AssertionError naming the first disagreement found."""
    tree.check_integrity()
    exact.check(mgr.block_size)
    free_list = list(mgr.free_ids)
    free = set(free_list)
    assert len(free_list) == len(free), "duplicate ids in the free list"
    # block id -> the namespace of the node holding it
    in_tree = {b.block_id: node.namespace for node, _ in tree.nodes()
               for b in node.blocks}
    for block in mgr.blocks:
        bid = block.block_id
        assert block.ref_count >= 0, f"negative ref count on {block!r}"
        if mgr.is_free(bid):
            assert bid in free, f"block {bid} marked free but not in free list"
            assert bid not in in_tree, f"block {bid} both free and in the tree"
            assert block.ref_count == 0, f"free block {bid} is referenced"
            assert block.node is None, f"free block {bid} still points at a tree node"
        else:
            assert bid in in_tree, f"block {bid} allocated but owned by nothing"
    assert len(free) + len(in_tree) == mgr.num_blocks, "free + used != total"
    if not has_disk:
        assert not any(n.on_disk for n, _ in tree.nodes()), "blocks on disk, no tier"
    for pin in pins:
        for bid in pin.block_ids:
            assert in_tree.get(bid) == pin.namespace, (
                f"pin {pin.pin_id} holds block {bid}, which its namespace's tree lacks")
    assert len(pins.block_ids) <= pins.cap, "more blocks pinned than the cap"
    for _, entry in exact.items():
        for block in entry.blocks:
            assert block.block_id in in_tree, "exact entry points at an evicted block"
            assert in_tree[block.block_id] == entry.namespace, (
                f"exact entry of namespace {entry.namespace!r} reads a block of "
                f"{in_tree[block.block_id]!r}")
