"""Radix tree (compressed prefix trie) over token ids, mapping prefixes to pool blocks.

Invariants (checked by `check`):
- every node starts at a block-aligned position; its blocks cover exactly its edge tokens;
- a node that ends mid-block is a leaf (children start at block boundaries);
- each block belongs to exactly one node;
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
from collections.abc import Iterator, Mapping, Sequence
from itertools import pairwise
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from kvchat.cache.blocks import Block


class Node:
    __slots__ = ("parent", "children", "tokens", "blocks", "start", "owners", "namespace")

    def __init__(self, parent: Node | None, start: int, tokens: list[int], blocks: list[Block],
                 namespace: str = ""):
        self.parent = parent
        self.namespace = namespace
        self.start = start
        self.tokens = tokens
        self.blocks = blocks
        self.children: dict[int, list[Node]] = {}
        self.owners: set[str] = set()  # session ids whose sequences pass through this node

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def child_list(self) -> list[Node]:
        return [c for group in self.children.values() for c in group]

    def add_child(self, child: Node) -> None:
        child.parent = self
        # groups stay sorted by tokens so a lookup can bisect them (see RadixTree._best_child)
        bisect.insort(self.children.setdefault(child.tokens[0], []), child, key=_tokens)

    def remove_child(self, child: Node, key: int | None = None) -> None:
        key = child.tokens[0] if key is None else key
        group = self.children[key]
        group.remove(child)
        if not group:
            del self.children[key]


def _tokens(node: Node) -> list[int]:
    return node.tokens


class PrefixMatch(NamedTuple):
    """Longest cached prefix of a token sequence."""

    matched: int  # tokens whose K/V are cached
    blocks: list[Block]  # covering positions [0, matched); the last may hold more tokens
    node: Node | None  # node where the match ended (None when matched == 0)
    at_leaf_end: bool  # the match consumed a whole leaf edge (an insert can extend it in place)


def _common_prefix(a: Sequence[int], b: Sequence[int], b_from: int) -> int:
    n = min(len(a), len(b) - b_from)
    i = 0
    while i < n and a[i] == b[b_from + i]:
        i += 1
    return i


class RadixTree:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
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

    def _top(self) -> list[Node]:
        """The roots' children: every namespace's first edges."""
        return [c for root in self.roots.values() for c in root.child_list()]

    # ---- plain-data form (the snapshot) --------------------------------------------------------

    def export(self) -> tuple[list[Block], list[dict[str, Any]]]:
        """The tree as plain data: its blocks in depth-first order, and the root's children as
        nested records {"start", "blocks" (indices into that list), "owners", "children"}; the
        roots' children also name their "namespace" (their descendants share it)."""
        blocks: list[Block] = []
        top: list[dict[str, Any]] = []
        stack = [(c, top) for c in reversed(self._top())]
        while stack:  # no recursion: a long chain of branch points must not hit the limit
            node, siblings = stack.pop()
            rec: dict[str, Any] = {
                "start": node.start,
                "blocks": list(range(len(blocks), len(blocks) + len(node.blocks))),
                "owners": sorted(node.owners),
                "children": [],
            }
            if node.parent is not None and node.parent.is_root:
                rec["namespace"] = node.namespace
            blocks.extend(node.blocks)
            siblings.append(rec)
            stack.extend((c, rec["children"]) for c in reversed(node.child_list()))
        return blocks, top

    @classmethod
    def from_records(
        cls, block_size: int, records: Sequence[Mapping[str, Any]], blocks: Sequence[Block]
    ) -> RadixTree:
        """Rebuild the tree `export` described over `blocks` (which already hold their tokens):
        edges are read from the blocks, first-block flags set; records without a "namespace"
        (older snapshots) are namespace "". Raises ValueError when the records do not describe
        a valid tree over those blocks."""
        tree = cls(block_size)
        try:
            # roots in the order the records name them, so nodes() iterates as before
            tops = [(rec, tree._root(str(rec.get("namespace", "")))) for rec in records]
            stack = tops[::-1]
            while stack:
                rec, parent = stack.pop()
                own = [blocks[int(i)] for i in rec["blocks"]]
                node = Node(parent, int(rec["start"]), [t for b in own for t in b.token_ids], own,
                            parent.namespace)
                node.owners = {str(o) for o in rec.get("owners", [])}
                for i, block in enumerate(own):
                    block.is_first_block = node.start == 0 and i == 0
                parent.add_child(node)
                children = list(rec["children"])
                if not children:
                    tree._leaves.add(node)
                stack.extend((c, node) for c in reversed(children))
            tree.check()
        except (KeyError, IndexError, TypeError, AssertionError) as exc:
            raise ValueError(f"not a radix tree ({type(exc).__name__}: {exc})") from exc
        return tree

    # ---- queries -----------------------------------------------------------------------------

    def _best_child(self, node: Node, tokens: Sequence[int], pos: int) -> tuple[Node | None, int]:
        group = node.children.get(tokens[pos]) if pos < len(tokens) else None
        if not group:
            return None, 0
        # Siblings share under a block of tokens, so their first blocks order them, and the one
        # sharing most with the query sits next to the query's place in that order: comparing
        # two of them, not every session that branched off here, keeps lookup O(len(tokens)).
        head = list(tokens[pos : pos + self.block_size])
        i = bisect.bisect_left(group, head, key=_tokens)
        best, best_len = None, 0
        for child in group[max(i - 1, 0) : i + 1]:
            n = _common_prefix(child.tokens, tokens, pos)
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
        bs = self.block_size
        while True:
            child, n = self._best_child(node, tokens, pos)
            if child is None:
                return PrefixMatch(pos, blocks, node if pos else None, pos > 0 and node.is_leaf)
            pos += n
            blocks.extend(child.blocks[: -(-n // bs)])
            if n < len(child.tokens):
                return PrefixMatch(pos, blocks, child, False)
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
        Writes each new block's token_ids and first-block flag. Nodes are `namespace`'s."""
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
        bs = self.block_size
        new_blocks = list(blocks[pos // bs :])
        for i, block in enumerate(new_blocks):
            lo = pos + i * bs
            block.token_ids = list(tokens[lo : lo + bs])
        if pos == 0:
            new_blocks[0].is_first_block = True
        leaf = Node(parent, pos, list(tokens[pos:]), new_blocks, parent.namespace)
        if owner is not None:
            leaf.owners.add(owner)
        self._leaves.discard(parent)
        parent.add_child(leaf)
        self._leaves.add(leaf)

    def _extend_leaf(self, leaf: Node, tokens: Sequence[int], blocks: Sequence[Block]) -> None:
        bs = self.block_size
        old_end = leaf.end
        first = leaf.start // bs
        for i in range(len(leaf.blocks) - 1, len(blocks) - first):
            block = blocks[first + i]
            if i >= len(leaf.blocks):
                leaf.blocks.append(block)
            elif block is not leaf.blocks[i]:
                raise AssertionError("extension must reuse the leaf's last block")
            lo = leaf.start + i * bs
            block.token_ids = list(tokens[lo : lo + bs])
        # no re-sort among siblings: a leaf is never a prefix of a sibling (it would have been
        # extended instead), so growing it cannot move it past one
        leaf.tokens.extend(tokens[old_end:])

    def _split(self, node: Node, at: int) -> Node:
        """Split node's edge at absolute block-aligned position `at`; returns the upper part."""
        bs = self.block_size
        cut = at - node.start
        upper = Node(node.parent, node.start, node.tokens[:cut], node.blocks[: cut // bs],
                     node.namespace)
        upper.owners = set(node.owners)
        parent = node.parent
        assert parent is not None
        parent.remove_child(node)
        parent.add_child(upper)
        node.tokens = node.tokens[cut:]
        node.blocks = node.blocks[cut // bs :]
        node.start = at
        upper.add_child(node)
        return upper

    def pop_leaf_block(self, leaf: Node) -> Block:
        """Drop the last block of a leaf (eviction); removes the node when it empties and merges
        a parent left with a single child, so the trie stays compressed."""
        if not leaf.is_leaf or leaf.is_root:
            raise ValueError("only leaf blocks can be evicted")
        key = leaf.tokens[0]
        block = leaf.blocks.pop()
        del leaf.tokens[len(leaf.blocks) * self.block_size :]
        if not leaf.blocks:
            parent = leaf.parent
            assert parent is not None
            parent.remove_child(leaf, key)
            self._leaves.discard(leaf)
            if parent.is_root:
                if parent.is_leaf and parent.namespace:  # an empty namespace leaves no trace
                    del self.roots[parent.namespace]
            elif parent.is_leaf:
                self._leaves.add(parent)
            elif len(parent.child_list()) == 1:
                self._merge_single_child(parent)
        return block

    def _merge_single_child(self, node: Node) -> None:
        self.merges += 1
        (child,) = node.child_list()
        node.remove_child(child)
        node.tokens.extend(child.tokens)
        node.blocks.extend(child.blocks)
        node.owners |= child.owners
        for grandchild in child.child_list():
            node.add_child(grandchild)
        if child in self._leaves:
            self._leaves.discard(child)
            self._leaves.add(node)

    def remove(self, tokens: Sequence[int], namespace: str = "") -> list[Block]:
        """Remove the leaf that ends exactly at `tokens` (if no one holds its blocks) and return
        its blocks for the caller to free. Returns [] when there is no such unheld leaf."""
        match = self.find_prefix(tokens, namespace)
        leaf = match.node
        if leaf is None or match.matched != len(tokens) or not match.at_leaf_end:
            return []
        if any(b.ref_count for b in leaf.blocks):
            return []
        out = []
        while leaf.blocks:
            out.append(self.pop_leaf_block(leaf))
        return out

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

    def check(self) -> None:
        """Raise AssertionError if a structural invariant is broken."""
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
            assert len(node.blocks) == -(-len(node.tokens) // bs), "blocks do not cover the edge"
            joined: list[int] = []
            for i, block in enumerate(node.blocks):
                assert block.block_id not in seen, f"block {block.block_id} in two nodes"
                seen.add(block.block_id)
                assert block.ref_count >= 0
                assert block.is_first_block == (node.start == 0 and i == 0), "first-block flag"
                joined.extend(block.token_ids)
            assert joined == node.tokens, "block tokens disagree with the edge"
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
        assert leaves == self._leaves, "leaf set out of date"
