"""Tombstones: a bounded memory of evicted blocks, so a later miss can say it was evicted
(`explain`: when, and by which policy). Records are keyed by the chained block keys the tree
already computed (`block_keys`), so recording an eviction costs no hashing. Torch-free.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvchat.cache.block_keys import next_key
from kvchat.cache.radix import common_prefix

if TYPE_CHECKING:
    from kvchat.cache.radix import RadixTree
    from kvchat.cache.radix_node import Node

Tombstone = tuple[str, str, tuple[int, ...], float, str]  # key, key before, tokens, when, policy


class Tombstones:
    """A bounded memory of evicted blocks, the oldest forgotten first: for each, the key of the
    block before it in its chain (`block_keys`: it names the namespace and every earlier
    token), its tokens, and when and by which policy it went. A prompt's own key chain finds
    them, and comparing tokens finds where inside an evicted block the prompt parts from it."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        # the block's own key -> (key before it, its tokens, when, policy)
        self._dead: OrderedDict[str, tuple[str, tuple[int, ...], float, str]] = OrderedDict()
        self._after: dict[str, set[str]] = {}  # key before -> evicted blocks that followed it

    def __len__(self) -> int:
        return len(self._dead)

    def record(self, key: str, prev: str, tokens: Sequence[int], policy: str,
               when: float | None = None) -> None:
        self._forget(key)
        self._dead[key] = (prev, tuple(tokens), time.time() if when is None else when, policy)
        self._after.setdefault(prev, set()).add(key)
        while len(self._dead) > self.capacity:
            self._forget(next(iter(self._dead)))

    def _forget(self, key: str) -> None:
        old = self._dead.pop(key, None)
        if old is not None:
            group = self._after[old[0]]
            group.discard(key)
            if not group:
                del self._after[old[0]]

    def record_node_block(self, tree: RadixTree, node: Node, nth: int, policy: str) -> None:
        """Block `nth` of `node`'s edge is going: remember it."""
        bs = tree.block_size
        self.record(node.keys[nth], tree.key_before(node, nth),
                    node.tokens[nth * bs : (nth + 1) * bs], policy)

    def record_subtree(self, tree: RadixTree, node: Node, first: int, policy: str) -> None:
        """Blocks `first`.. of `node`'s edge and every block below it are going: remember
        them (a bounded memory: beyond `capacity`, the oldest records go first)."""
        stack = [(node, first)]
        while stack:
            top, start = stack.pop()
            for nth in range(start, len(top.keys)):
                self.record_node_block(tree, top, nth, policy)
            stack.extend((c, 0) for c in top.child_list())

    def longest(self, tree: RadixTree, namespace: str, prompt: Sequence[int], start: int
                ) -> tuple[int, float, str] | None:
        """How far `prompt` ran through evicted blocks, when past `start` tokens: (through,
        when, policy) of the block it got furthest in."""
        bs, n = tree.block_size, len(prompt)
        found: tuple[int, float, str] | None = None
        prev = tree.root_key(namespace)
        for lo in range(0, n, bs):
            part = prompt[lo : lo + bs]
            for key in self._after.get(prev, ()):
                _, tokens, when, policy = self._dead[key]
                through = lo + common_prefix(tokens, part)
                if through > max(start, lo) and (found is None or through > found[0]):
                    found = (through, when, policy)
            if len(part) < bs:
                break
            prev = next_key(prev, part)
        return found

    def rows(self) -> tuple[Tombstone, ...]:
        """Every record, oldest first (what a snapshot keeps)."""
        return tuple((k, prev, t, w, p) for k, (prev, t, w, p) in self._dead.items())

    def to_json(self) -> list[list[Any]]:
        return [[k, prev, list(t), w, p] for k, prev, t, w, p in self.rows()]

    @classmethod
    def from_json(cls, rows: Iterable[Sequence[Any]], capacity: int = 4096) -> Tombstones:
        out = cls(capacity)
        for key, prev, tokens, when, policy in rows:
            out.record(str(key), str(prev), [int(t) for t in tokens], str(policy), float(when))
        return out
