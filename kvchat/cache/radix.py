"""Radix tree (compressed prefix trie) over token ids, mapping prefixes to pool blocks.

Invariants (checked by `check_integrity`):
- every node starts at a block-aligned position; it has one key per block of its edge
  (`block_keys`: chained over the namespace and every token through the block); its resident
  blocks (in the pool) are a prefix of those, the rest are on disk, in the BlockStore;
- no resident block lies below an on-disk one, so a path from a root is resident up to some
  point and on disk after it;
- a node that ends mid-block is a leaf (children start at block boundaries);
- each block belongs to exactly one node, and points back at it (`Block.node`, `Block.index`):
  block i of a node holds node.tokens[i*bs:(i+1)*bs], which only the node keeps;
- every node belongs to one namespace, that of the root it hangs from.

Namespaces keep caches apart inside one pool: each has its own root (created by its first
insert, dropped when its last node is evicted), so a lookup in one never matches another's
tokens. Namespace "" (the standalone cache) always has a root, `root`.

Matches are token-granular: a lookup may end inside an edge, even inside a block, because the K/V of
position i depends only on tokens <= i. An insert that diverges mid-block starts its branch at the
previous block boundary; the caller copies the shared head of that block into the branch's own
block. Siblings may therefore share up to block_size - 1 leading tokens.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, NamedTuple

from kvchat.cache.block_keys import next_key, root_key
from kvchat.cache.radix_node import Node, edge_tokens, place

if TYPE_CHECKING:
    from kvchat.cache.blocks import Block

RootKey = Callable[[str], str]  # namespace -> the start of its key chain (`root_key`)


class DiskBlock(NamedTuple):
    """A matched block that is only on disk: block number `nth` of `node`'s edge."""

    node: Node
    nth: int

    @property
    def key(self) -> str:
        return self.node.keys[self.nth]


class PrefixMatch(NamedTuple):
    """Longest cached prefix of a token sequence, through both tiers."""

    matched: int  # tokens whose K/V are cached, in the pool or on disk
    blocks: list[Block]  # resident blocks from position 0 on; the last may hold more tokens
    node: Node | None  # node where the match ended (None when matched == 0)
    at_leaf_end: bool  # the match consumed a whole leaf edge (an insert can extend it in place)
    disk: tuple[DiskBlock, ...] = ()  # the matched blocks after `blocks`, on disk, in order

    def resident(self, block_size: int) -> int:
        """Matched tokens whose K/V are in the pool."""
        return len(self.blocks) * block_size if self.disk else self.matched


def _default_root_key(namespace: str) -> str:
    """Keys of a tree no disk tier reads: unique per namespace, tied to no model."""
    return root_key({}, namespace)


def common_prefix(a: Sequence[int], b: Sequence[int], b_from: int = 0) -> int:
    """How many leading tokens of `a` equal those of `b` from position `b_from` on."""
    n = min(len(a), len(b) - b_from)
    i = 0
    while i < n and a[i] == b[b_from + i]:
        i += 1
    return i


class RadixTree:
    def __init__(self, block_size: int, root_key: RootKey | None = None) -> None:
        self.block_size = block_size
        self._root_key = root_key or _default_root_key
        self._root_keys: dict[str, str] = {}
        self.roots: dict[str, Node] = {"": Node(None, 0, [], [])}
        self._leaves: set[Node] = set()
        self.merges = 0  # node merges so far (eviction watches it: merges move blocks)

    @property
    def root(self) -> Node:
        """The root of namespace "" (the standalone cache)."""
        return self.roots[""]

    def _root(self, namespace: str) -> Node:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = Node(None, 0, [], [], namespace)
        return root

    def root_key(self, namespace: str) -> str:
        key = self._root_keys.get(namespace)
        if key is None:
            key = self._root_keys[namespace] = self._root_key(namespace)
        return key

    def key_before(self, node: Node, nth: int) -> str:
        """The chain's key just before block `nth` of the node's edge (what its key follows)."""
        if nth:
            return node.keys[nth - 1]
        if node.parent is not None and not node.parent.is_root:
            return node.parent.keys[-1]
        return self.root_key(node.namespace)

    def _rekey(self, node: Node, first: int) -> None:
        """Recompute the node's keys from block `first` on (its tokens there changed)."""
        bs = self.block_size
        del node.keys[first:]
        prev = self.key_before(node, first)
        for i in range(first, -(-len(node.tokens) // bs)):
            prev = next_key(prev, node.tokens[i * bs : (i + 1) * bs])
            node.keys.append(prev)

    def graft(self, parent: Node | None, namespace: str, tokens: list[int]) -> Node:
        """Add a node whose blocks are all on disk under `parent` (None: the namespace's root),
        keys computed (the index file's rebuild, which adds a node's children after it)."""
        above = parent or self._root(namespace)
        node = Node(above, above.end if parent else 0, tokens, [], above.namespace)
        above.add_child(node)
        self._rekey(node, 0)
        self._leaves.discard(above)
        self._leaves.add(node)
        return node

    def _top(self) -> list[Node]:
        """The roots' children: every namespace's first edges."""
        return [c for root in self.roots.values() for c in root.child_list()]

    # ---- queries -----------------------------------------------------------------------------

    def _best_child(self, node: Node, tokens: Sequence[int], pos: int) -> tuple[Node | None, int]:
        group = node.children.get(tokens[pos]) if pos < len(tokens) else None
        if not group:
            return None, 0
        # Siblings share under a block of tokens, so their first blocks order them, and the one
        # sharing most with the query sits next to the query's place in that order: comparing
        # two of them, not every session that branched off here, keeps lookup O(len(tokens)).
        head = list(tokens[pos : pos + self.block_size])
        i = bisect.bisect_left(group, head, key=edge_tokens)
        best, best_len = None, 0
        for child in group[max(i - 1, 0) : i + 1]:
            n = common_prefix(child.tokens, tokens, pos)
            if n > best_len:
                best, best_len = child, n
        return best, best_len

    def find_prefix(self, tokens: Sequence[int], namespace: str = "") -> PrefixMatch:
        """Walk edges while tokens match, inside `namespace` only; O(len(tokens)), independent
        of how much is cached."""
        root = self.roots.get(namespace)
        if root is None:
            return PrefixMatch(0, [], None, False)
        node, pos = root, 0
        blocks: list[Block] = []
        disk: list[DiskBlock] = []
        bs = self.block_size
        while True:
            child, n = self._best_child(node, tokens, pos)
            if child is None:
                return PrefixMatch(pos, blocks, node if pos else None, pos > 0 and node.is_leaf,
                                   tuple(disk))
            pos += n
            used = -(-n // bs)
            blocks.extend(child.blocks[:used])
            disk.extend(DiskBlock(child, i) for i in range(len(child.blocks), used))
            if n < len(child.tokens):
                return PrefixMatch(pos, blocks, child, False, tuple(disk))
            node = child

    # ---- mutation ----------------------------------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int],
        blocks: Sequence[Block],
        owner: str | None = None,
        namespace: str = "",
    ) -> None:
        """Register `tokens` whose K/V live in `blocks` (block i covers positions
        [i*bs, (i+1)*bs)). Blocks for the already cached part must be the tree's own blocks (as
        `find_prefix` returned them, or a fresh copy where the branch diverges mid-block).
        The new blocks then read their tokens from their node. Nodes are `namespace`'s."""
        bs = self.block_size
        n = len(tokens)
        if len(blocks) != -(-n // bs):
            raise ValueError(f"{n} tokens need {-(-n // bs)} blocks, got {len(blocks)}")
        if n == 0:
            return
        node, pos = self._root(namespace), 0
        while pos < n:
            child, common = self._best_child(node, tokens, pos)
            if child is None:
                if pos % bs:
                    raise AssertionError("branch would start mid-block")
                self._attach(node, pos, tokens, blocks, owner)
                return
            if owner is not None and (common == len(child.tokens) or pos + common == n):
                # branching off mid-edge: only the upper part of a split (below) is on our path
                child.owners.add(owner)
            if common == len(child.tokens):
                pos += common
                if pos < n and child.is_leaf:
                    self._extend_leaf(child, tokens, blocks)
                    return
                node = child
                continue
            if pos + common == n:
                return  # a prefix of what is cached: nothing new
            split_at = (pos + common) // bs * bs
            if split_at > child.start:
                child = self._split(child, split_at)
                if owner is not None:
                    child.owners.add(owner)
                node, pos = child, split_at
            self._attach(node, pos, tokens, blocks, owner)
            return

    def _attach(
        self,
        parent: Node,
        pos: int,
        tokens: Sequence[int],
        blocks: Sequence[Block],
        owner: str | None,
    ) -> None:
        new_blocks = list(blocks[pos // self.block_size :])
        leaf = Node(parent, pos, list(tokens[pos:]), new_blocks, parent.namespace)
        place(new_blocks, leaf)
        if owner is not None:
            leaf.owners.add(owner)
        self._leaves.discard(parent)
        parent.add_child(leaf)
        self._rekey(leaf, 0)
        self._leaves.add(leaf)

    def _extend_leaf(self, leaf: Node, tokens: Sequence[int], blocks: Sequence[Block]) -> None:
        bs = self.block_size
        old_end = leaf.end
        first = leaf.start // bs
        held = len(leaf.blocks)
        if blocks[first + held - 1] is not leaf.blocks[-1]:
            raise AssertionError("extension must reuse the leaf's last block")
        leaf.blocks.extend(blocks[first + held :])
        place(leaf.blocks[held:], leaf, held)
        # no re-sort among siblings: a leaf is never a prefix of a sibling (it would have been
        # extended instead), so growing it cannot move it past one
        leaf.tokens.extend(tokens[old_end:])
        self._rekey(leaf, (old_end - leaf.start) // bs)  # the old last block may have grown

    def _split(self, node: Node, at: int) -> Node:
        """Split node's edge at absolute block-aligned position `at`; returns the upper part."""
        bs = self.block_size
        cut = at - node.start
        upper = Node(node.parent, node.start, node.tokens[:cut], node.blocks[: cut // bs],
                     node.namespace)
        upper.owners = set(node.owners)
        upper.keys, node.keys = node.keys[: cut // bs], node.keys[cut // bs :]
        parent = node.parent
        assert parent is not None
        parent.remove_child(node)
        parent.add_child(upper)
        node.tokens = node.tokens[cut:]
        node.blocks = node.blocks[cut // bs :]
        node.start = at
        upper.add_child(node)
        place(upper.blocks, upper)
        place(node.blocks, node)
        return upper

    def pop_block(self, node: Node) -> Block:
        """Drop the node's last resident block and all after it (on disk: the rest of its edge
        and its descendants); see `truncate`."""
        if node.is_root or not node.blocks or any(c.blocks for c in node.child_list()):
            raise ValueError("only a last resident block can be evicted")
        block = node.blocks[-1]
        self.truncate(node, len(node.blocks) - 1)
        return block

    def spill_block(self, node: Node) -> Block:
        """Move the node's last resident block to the disk tier: it leaves `blocks` (the
        caller frees it), its tokens and key stay."""
        if node.is_root or not node.blocks or any(c.blocks for c in node.child_list()):
            raise ValueError("only a last resident block can be spilled")
        block = node.blocks.pop()
        place([block], None)
        return block

    def attach_block(self, node: Node, block: Block) -> None:
        """Make the node's first on-disk block resident again, in `block` (a disk hit)."""
        i = len(node.blocks)
        if i >= len(node.keys):
            raise ValueError("the node has no block on disk")
        node.blocks.append(block)
        place([block], node, i)

    def truncate(self, node: Node, n_blocks: int) -> None:
        """Keep the node's first n_blocks blocks (all resident ones among them stay); the
        rest of its edge and every descendant go, none of which may hold resident blocks
        beyond those kept. A node left empty is removed."""
        key = node.tokens[0]
        place(node.blocks[n_blocks:], None)
        del node.blocks[n_blocks:]
        for child in node.child_list():
            self._drop_subtree(child)
        del node.tokens[n_blocks * self.block_size :]
        del node.keys[n_blocks:]
        if node.tokens:
            self._leaves.add(node)
            return
        parent = node.parent
        assert parent is not None
        parent.remove_child(node, key)
        self._leaves.discard(node)
        if parent.is_root:
            if parent.is_leaf and parent.namespace:  # an empty namespace leaves no trace
                del self.roots[parent.namespace]
        elif parent.is_leaf:
            self._leaves.add(parent)
        elif len(parent.child_list()) == 1:
            self._merge_single_child(parent)

    def _drop_subtree(self, top: Node) -> None:
        """Remove a subtree that holds no resident block (it is only on disk)."""
        stack = [top]
        while stack:
            node = stack.pop()
            assert not node.blocks, "dropping a subtree with resident blocks"
            self._leaves.discard(node)
            stack.extend(node.child_list())
        assert top.parent is not None
        top.parent.remove_child(top)

    def _merge_single_child(self, node: Node) -> None:
        self.merges += 1
        (child,) = node.child_list()
        node.remove_child(child)
        node.tokens.extend(child.tokens)
        place(child.blocks, node, len(node.blocks))
        node.blocks.extend(child.blocks)  # a parent with blocks on disk has no resident child
        node.keys.extend(child.keys)
        node.owners |= child.owners
        for grandchild in child.child_list():
            node.add_child(grandchild)
        if child in self._leaves:
            self._leaves.discard(child)
            self._leaves.add(node)

    def drop_disk(self) -> int:
        """Forget every block that is only on disk; returns how many went."""
        frontier = [n for n, _ in self.nodes()
                    if n.on_disk and (n.parent is None or n.parent.is_root or not n.parent.on_disk)]
        dropped = sum(n.on_disk for n, _ in self.nodes())
        for node in frontier:
            self.truncate(node, len(node.blocks))
        return dropped

    def clear(self) -> None:
        self.roots = {"": Node(None, 0, [], [])}
        self._leaves.clear()

    # ---- iteration ---------------------------------------------------------------------------

    def leaves(self) -> Iterator[Node]:
        return iter(self._leaves)

    def nodes(self) -> Iterator[tuple[Node, int]]:
        """(node, depth) in depth-first order, roots excluded, children in insertion order;
        namespace "" first, then the others in the order they were created."""
        stack = [(c, 1) for c in reversed(self._top())]
        while stack:
            node, depth = stack.pop()
            yield node, depth
            stack.extend((c, depth + 1) for c in reversed(node.child_list()))

    def all_blocks(self) -> Iterator[Block]:
        for node, _ in self.nodes():
            yield from node.blocks

    @property
    def num_tokens(self) -> int:
        return sum(len(node.tokens) for node, _ in self.nodes())

    def check_integrity(self) -> None:
        """Raise AssertionError if a structural invariant (the module docstring's) is broken."""
        bs = self.block_size
        seen: set[int] = set()
        leaves = set()
        for node, _ in self.nodes():
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
            # blocks hold no tokens of their own: where they point is all there is to check
            for i, block in enumerate(node.blocks):
                assert block.block_id not in seen, f"block {block.block_id} in two nodes"
                seen.add(block.block_id)
                assert block.ref_count >= 0
                assert block.node is node and block.index == i, (
                    f"{block!r} does not point back at block {i} of its node")
            if node.children:
                assert node.end % bs == 0, "inner node ends mid-block"
                for key, group in node.children.items():
                    assert group and all(c.tokens[0] == key for c in group)
                    assert all(a.tokens < b.tokens for a, b in pairwise(group)), "order"
            else:
                leaves.add(node)
        assert "" in self.roots, "namespace \"\" has no root"
        for namespace, root in self.roots.items():
            assert root.is_root and root.namespace == namespace, "root of another namespace"
            assert not root.tokens and not root.blocks, "a root holds tokens"
            assert root.children or not namespace, f"empty namespace {namespace!r} kept"
            for key, group in root.children.items():
                assert group and all(c.tokens[0] == key for c in group)
                assert all(a.tokens < b.tokens for a, b in pairwise(group)), "order"
        assert leaves == set(self.leaves()), "leaf set out of date"
