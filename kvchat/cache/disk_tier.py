"""The cache's side of the disk tier: moving blocks between the pool and its BlockBackend.

A spilled block leaves the pool but keeps its node, tokens and key in the radix tree; a lookup
(or a store) that reaches it brings it back with `load`. A block the store cannot serve (its
file missing, short or failing its checksum) is pruned from the tree with everything below it,
so it is never served and never asked for again.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from kvchat.cache.block_backend import ReadStatus
from kvchat.cache.radix import PrefixMatch
from kvchat.files import write_error

if TYPE_CHECKING:
    from kvchat.cache.block_backend import BlockBackend
    from kvchat.cache.blocks import Block, BlockManager
    from kvchat.cache.radix import DiskBlock, RadixTree
    from kvchat.cache.radix_node import Node


class Loaded(NamedTuple):
    """What `load` brought back: resident blocks now extending the match, in order, whether
    the rest was pruned (a block the store could not serve), and notices for the user."""

    blocks: list[Block]
    pruned: bool
    notices: list[str]


def spills(store: BlockBackend | None) -> bool:
    """Evicted blocks go to disk (else they are dropped, as without a disk tier)."""
    return store is not None and store.enabled and store.layout.payload_bytes <= store.budget_bytes


def spill(store: BlockBackend, manager: BlockManager, tree: RadixTree, node: Node) -> Block:
    """Write the node's last resident block to the store (queued; the writer thread does the
    disk work) and take it out of the tree's resident blocks; the caller frees it."""
    block = node.blocks[-1]
    store.put(node.keys[len(node.blocks) - 1], block.token_ids,
              manager.block_tensors(block.block_id))
    return tree.spill_block(node)


def load_match(store: BlockBackend, manager: BlockManager, tree: RadixTree, match: PrefixMatch,
               evict: Callable[[int], int]) -> tuple[PrefixMatch, Loaded]:
    """`match` with its on-disk blocks loaded back into the pool (`evict` makes room), or as
    much of it as could be: a block the store cannot serve is pruned with everything below
    it, and the match then ends before it. Holds no reference on return."""
    bs = tree.block_size
    resident = match.resident(bs)
    for block in match.blocks:  # our own path stays out of the eviction below
        block.acquire()
    try:
        short = len(match.disk) - manager.num_free
        if short > 0:
            evict(short)
        got = load(store, manager, tree, match.disk)
    finally:
        for block in match.blocks:
            block.release()
    blocks = match.blocks + got.blocks
    if len(got.blocks) == len(match.disk):
        return PrefixMatch(match.matched, blocks, match.node, match.at_leaf_end), got
    # blocks before an unloaded one are full: the match ends on a block boundary
    matched = len(blocks) * bs if got.blocks else resident
    return PrefixMatch(min(matched, match.matched), blocks, None, False), got


def load(store: BlockBackend, manager: BlockManager, tree: RadixTree,
         disk: Sequence[DiskBlock]) -> Loaded:
    """Read `disk`'s blocks into free pool blocks, in order, and reattach them to their nodes;
    stops when the pool has no free block left. The caller makes room first."""
    bs = tree.block_size
    out: list[Block] = []
    notices: list[str] = []
    for item in disk:
        if not manager.num_free:
            break
        expected = item.node.tokens[item.nth * bs : (item.nth + 1) * bs]
        got = store.get(item.key)
        if got.notice:
            notices.append(got.notice)
        if got.status is not ReadStatus.HIT or got.kv is None or list(got.tokens) != expected:
            if got.status is ReadStatus.HIT:
                notices.append(f"Disk cache block {item.key[:12]} holds other tokens; not used.")
            tree.truncate(item.node, item.nth)
            return Loaded(out, True, notices)
        record = {"last_accessed": 0, "attn_score": 0.0}
        (block,) = manager.import_blocks([record], [(k[None], v[None]) for k, v in got.kv])
        tree.attach_block(item.node, block)
        out.append(block)
    return Loaded(out, False, notices)


def persist(store: BlockBackend, manager: BlockManager, tree: RadixTree,
            bury: Callable[[Node, int], None] = lambda node, first: None) -> None:
    """Make the store hold every block of the tree, then wait until it is on disk: resident
    blocks not stored yet are written (a stored one costs a dict lookup); on-disk blocks
    whose files the store evicted to stay in budget are pruned, since they cannot be served
    (`bury(node, first)` is told first, so later misses can say they were evicted). Raises
    WriteError when a block written for this save could not be written; blocks the store
    evicted to stay within its budget are no failure (they are pruned, or left to be
    pruned when their node next merges)."""
    failures = store.stats().write_failures
    for node, _ in tree.nodes():
        for i, block in enumerate(node.blocks):
            # listed blocks cost no stat here: a spill re-checks (put) before dropping one
            if not store.exists(node.keys[i]):
                store.put(node.keys[i], block.token_ids, manager.block_tensors(block.block_id))
    store.flush()  # written, and the store back within its budget: what is gone is gone
    prune: list[tuple[Node, int]] = []
    stack = [c for root in tree.roots.values() for c in root.child_list()]
    while stack:  # top-down: nothing below a pruned block is visited
        node = stack.pop()
        gone = next((i for i in range(len(node.keys)) if not store.exists(node.keys[i])), None)
        if gone is None or gone < len(node.blocks):  # a resident block can be written again
            stack.extend(node.child_list())
        else:
            prune.append((node, gone))
    for node, gone in prune:
        parent = node.parent
        # a sibling's removal may have merged this node into its parent: pruned next time
        if parent is not None and node in parent.children.get(node.tokens[0], ()):
            bury(node, gone)
            tree.truncate(node, gone)
    if store.stats().write_failures > failures:
        _check_stored(store, tree)


def _check_stored(store: BlockBackend, tree: RadixTree) -> None:
    """Raise WriteError when the store lacks blocks of the tree after writes of this save
    failed (a full disk), rather than let an index name blocks that are not there."""
    missing = sum(not store.exists(key) for node, _ in tree.nodes() for key in node.keys)
    if missing and spills(store):
        path, exc = getattr(store, "write_failure", None) or (
            Path(store.describe()) / "blocks", OSError(errno.EIO, "not stored"))
        raise write_error(f"{missing} of the cache's blocks into the disk tier", path, exc)
