"""Eviction: policies (one Protocol, three small classes), the leaf-first walk, and where
each block it takes goes.

Candidates handed to `select_victim` are always evictable leaf blocks (ref_count == 0, nothing
cached after them), so no policy can orphan a longer cached prefix; the policy only ranks them.
`leaf_first` takes them off the tree in the policy's order; `evict_leaves` runs it over a
cache, spilling each block to the disk tier or dropping it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kvchat.cache import disk_tier
from kvchat.config import normalise_policy

if TYPE_CHECKING:
    from kvchat.cache.blocks import Block
    from kvchat.cache.kvcache import PagedKVCache
    from kvchat.cache.radix import RadixTree
    from kvchat.cache.radix_node import Node


class EvictionPolicy(Protocol):
    name: str

    def on_access(self, block: Block) -> None:
        """A block was read or written: update its timestamp or score."""

    def select_victim(self, candidates: Sequence[Block]) -> Block | None:
        """Pick one block to evict from evictable leaf blocks, or None if none may go."""

    def rank(self, block: Block) -> tuple[float, ...] | None:
        """The order select_victim follows (smallest first), or None if the block may not go:
        lets the cache evict many blocks with one heap instead of one scan per block."""

    def record_attention(self, block: Block, score: float) -> None:
        """Attention mass the block received (used by H2O; others ignore it)."""

    def state(self) -> dict[str, Any]:
        """The policy's own state beyond the blocks' metadata, JSON-ready (for the snapshot)."""

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state()` saved earlier; keys it does not know are ignored, so a
        snapshot written under another policy still loads."""


class LRU:
    """Evict the least recently used block. Cheap and predictable; the baseline."""

    name = "lru"

    def __init__(self) -> None:
        self._clock = 0  # a logical clock: deterministic, and strictly increasing per access

    def on_access(self, block: Block) -> None:
        self._clock += 1
        block.last_accessed = self._clock

    def select_victim(self, candidates: Sequence[Block]) -> Block | None:
        allowed = [b for b in candidates if self._may_evict(b)]
        return min(allowed, key=self._rank, default=None)

    def rank(self, block: Block) -> tuple[float, ...] | None:
        return self._rank(block) if self._may_evict(block) else None

    def record_attention(self, block: Block, score: float) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {"clock": self._clock}

    def restore(self, state: Mapping[str, Any]) -> None:
        # never run the clock back: restored blocks must stay older than the next access
        self._clock = max(self._clock, int(state.get("clock", 0)))

    def _may_evict(self, block: Block) -> bool:
        return block.ref_count == 0

    def _rank(self, block: Block) -> tuple[float, ...]:
        return (block.last_accessed, block.block_id)


class SinkLRU(LRU):
    """LRU that never evicts a sequence's first block: the attention sink (StreamingLLM)."""

    name = "sink-lru"

    def _may_evict(self, block: Block) -> bool:
        return block.ref_count == 0 and not block.is_first_block


class H2O(SinkLRU):
    """Heavy-hitter oracle: evict the block that received the least attention mass; first
    blocks protected; ties broken by age. Scores come from the backend's attention weights."""

    name = "h2o"

    def record_attention(self, block: Block, score: float) -> None:
        block.attn_score += score

    def _rank(self, block: Block) -> tuple[float, ...]:
        return (block.attn_score, block.last_accessed, block.block_id)


POLICIES: dict[str, type[LRU]] = {"lru": LRU, "sink-lru": SinkLRU, "h2o": H2O}


def make_policy(name: str | None = None) -> EvictionPolicy:
    """Policy by name, else from $EVICTION_POLICY, else LRU; unknown names list the valid ones."""
    return POLICIES[normalise_policy(name)]()


Rank = Callable[["Block"], "tuple[float, ...] | None"]


def leaf_first(tree: RadixTree, n: int, rank: Rank, take: Callable[[Node], None]) -> int:
    """Take up to n blocks in `rank`'s order (None: the block may not go); returns how many
    went. `take(node)` removes the node's last resident block (drops or spills it).

    Candidates are the last resident blocks of nodes without a resident descendant (the leaves,
    without a disk tier), in one heap; when a node loses its last resident block, its parent
    may become one. Only a merge of a parent with its single remaining child moves blocks
    between nodes, so the heap is rebuilt then.
    """
    Heap = list[tuple[tuple[float, ...], int]]

    def candidate(node: Node | None) -> bool:
        return (node is not None and not node.is_root and bool(node.blocks)
                and not any(c.blocks for c in node.child_list()))

    def push(heap: Heap, owner: dict[int, Node], node: Node) -> None:
        block = node.blocks[-1]
        key = rank(block) if block.ref_count == 0 else None
        if key is not None:
            heapq.heappush(heap, (key, block.block_id))
            owner[block.block_id] = node

    def build() -> tuple[Heap, dict[int, Node]]:
        heap: Heap = []
        owner: dict[int, Node] = {}
        for node, _ in tree.nodes():
            if candidate(node):
                push(heap, owner, node)
        return heap, owner

    heap, owner = build()
    done = 0
    while done < n and heap:
        _, bid = heapq.heappop(heap)
        node = owner.pop(bid)
        parent = node.parent
        merges_before = tree.merges
        take(node)
        done += 1
        if tree.merges != merges_before:
            heap, owner = build()
        elif node.blocks:
            push(heap, owner, node)
        elif candidate(parent):
            assert parent is not None
            push(heap, owner, parent)
    return done


class Evicted(NamedTuple):
    taken: int  # blocks that left the pool
    spilled: int  # of which went to the disk tier (they stay in the tree)


def evict_leaves(cache: PagedKVCache, n: int, rank: Rank | None = None,
                 spill: bool | None = None, why: str | None = None) -> Evicted:
    """Evict up to n of the cache's unpinned blocks, leaf first, in `rank`'s order (default:
    the policy's; `leaf_first`). With a disk tier (and `spill` not False) each goes to disk and
    stays in the tree; else it is dropped, and remembered as a tombstone naming `why`
    (default: the policy) so a later miss can say it was evicted."""
    base = rank or cache.policy.rank
    pins, exact, manager, store = cache.pins, cache.exact, cache.manager, cache.disk
    to_disk = spill is not False and disk_tier.spills(store)
    tree, why = cache.tree, why or cache.policy.name

    def ranked(block: Block) -> tuple[float, ...] | None:
        return None if pins.holds(block.block_id) else base(block)

    def take(node: Node) -> None:
        victim = node.blocks[-1]
        gone = exact.take_block(victim)
        if to_disk and store is not None:
            exact.park(gone)  # exact again once the path loads back
            disk_tier.spill(store, manager, tree, node)
        else:
            cache.tombstones.record_node_block(tree, node, len(node.blocks) - 1, why)
            tree.pop_block(node)
        manager.free([victim])

    done = leaf_first(tree, n, ranked, take)
    return Evicted(done, done if to_disk else 0)
