"""Node: one edge of the radix tree (`radix.RadixTree`): its tokens, the blocks holding their
K/V (the resident ones, a prefix of the edge's), one key per block, its children and owners;
and `place`, the one way a block learns which node and position holds it."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvchat.cache.blocks import Block


class Node:
    __slots__ = ("parent", "children", "tokens", "blocks", "keys", "start", "owners",
                 "namespace")

    def __init__(self, parent: Node | None, start: int, tokens: list[int], blocks: list[Block],
                 namespace: str = ""):
        self.parent = parent
        self.namespace = namespace
        self.start = start
        self.tokens = tokens
        self.blocks = blocks  # the resident ones: a prefix of the edge's blocks
        self.keys: list[str] = []  # one per block of the edge, resident or on disk
        self.children: dict[int, list[Node]] = {}
        self.owners: set[str] = set()  # session ids whose sequences pass through this node

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def on_disk(self) -> int:
        """Blocks of this edge that are only on disk."""
        return len(self.keys) - len(self.blocks)

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
        bisect.insort(self.children.setdefault(child.tokens[0], []), child, key=edge_tokens)

    def remove_child(self, child: Node, key: int | None = None) -> None:
        key = child.tokens[0] if key is None else key
        group = self.children[key]
        group.remove(child)
        if not group:
            del self.children[key]


def edge_tokens(node: Node) -> list[int]:
    return node.tokens


def place(blocks: Sequence[Block], node: Node | None, first: int = 0) -> None:
    """Tell each block where it now lies: block `first + i` of node's edge (None: out of the
    tree). Every move of blocks between nodes goes through here, so a block's tokens and
    first-block flag, read from its node, are always those of the edge holding it."""
    for i, block in enumerate(blocks, first):
        block.node, block.index = node, i
