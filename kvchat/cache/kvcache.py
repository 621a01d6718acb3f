"""PagedKVCache: the facade the engine talks to (lookup, gather, store, release, stats).

Lookup is two-layer: the exact index first (whole prompt, with its last logits: no forward pass
needed), then the radix tree (longest cached prefix, token-granular). Store evicts leaf blocks
through the policy when the pool is short, writes the new K/V, and registers the sequence in both
layers. Blocks a lookup (or a store with hold=True) hands out are acquired; the caller releases
them when its request ends. Blocks the tree owns carry no reference.

With a disk tier (a BlockStore, `use_store`), eviction spills a block to disk instead of
dropping it: the tree keeps its node, tokens and key, and a lookup that reaches it loads it back
(a disk hit, HitSource.DISK). Without one, evicted blocks leave the tree as before.

Every lookup, peek and store names a namespace ("" by default): entries stored in one are never
a hit in another, so callers that must not learn of each other's prompts (a server's tenants)
share the pool but no blocks. Eviction ranks all namespaces' blocks together.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from kvchat.cache import disk_tier
from kvchat.cache.block_keys import root_key
from kvchat.cache.blocks import KV, Block, BlockManager
from kvchat.cache.eviction import EvictionPolicy, make_policy
from kvchat.cache.exact import ExactIndex
from kvchat.cache.radix import Node, PrefixMatch, RadixTree
from kvchat.cache.stats import CacheStats, Counters, SessionCounters
from kvchat.config import CacheConfig

if TYPE_CHECKING:
    from kvchat.cache.store import BlockStore

class CacheIntegrityError(AssertionError):
    """The cache's bookkeeping contradicts itself (a bug, never a user error)."""


class HitSource(StrEnum):
    EXACT = "exact"
    RADIX = "radix"
    DISK = "disk"  # part of the hit was loaded back from the disk tier
    MISS = "miss"


class Lookup(NamedTuple):
    """A lookup's hit. `blocks` are acquired for the caller, who releases them (`release`)
    when its request ends; until then no eviction touches them."""

    matched: int  # prompt tokens whose K/V come from the cache
    blocks: tuple[Block, ...]  # cover positions [0, matched)
    source: HitSource
    logits: torch.Tensor | None  # last position's logits (exact hits only): no forward needed
    prompt_tokens: int
    disk_tokens: int = 0  # of `matched`, tokens whose blocks were loaded from the disk tier


class StoreResult(NamedTuple):
    """What a store cached. `blocks` cover positions [0, stored). They are acquired for the
    caller only when it passed hold=True (then it releases them); otherwise they are the
    tree's, valid until the next call that mutates the cache (store, evict, clear, reset)."""

    stored: int  # leading tokens of the sequence now cached
    new_tokens: int  # of which this call wrote
    blocks: tuple[Block, ...]
    complete: bool  # False when the pool could not hold the whole sequence
    evicted: int  # blocks evicted to make room


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCache:
    def __init__(
        self,
        manager: BlockManager,
        policy: EvictionPolicy | str | None = None,
        max_exact_entries: int = 256,
    ) -> None:
        self.manager = manager
        self.block_size = manager.block_size
        self.policy: EvictionPolicy = (
            policy if policy is not None and not isinstance(policy, str) else make_policy(policy)
        )
        self.tree = RadixTree(manager.block_size)
        self.exact = ExactIndex(max_exact_entries)
        self._sessions: dict[str, SessionCounters] = {}  # updated in place: one per session
        self._counters = Counters(sessions=self._sessions)
        self.disk: BlockStore | None = None
        # exact entries saved by an earlier process: (namespace, tokens) -> their logits' loader
        self.saved_exact: dict[tuple[str, tuple[int, ...]], Callable[[], Any]] = {}
        self._root_key: Callable[[str], str] | None = None
        self._notices: list[str] = []

    def use_store(self, store: BlockStore | None, fingerprint: Mapping[str, Any]) -> None:
        """Spill evicted blocks to `store` and load them back on a hit. Block keys chain from
        `fingerprint` (what must match for K/V to be reusable) and the namespace, so tenants
        never share a block. Call it while the cache is empty."""
        if self.manager.num_free != self.manager.num_blocks or any(True for _ in self.tree.nodes()):
            raise ValueError("use_store needs an empty cache")
        fp = dict(fingerprint)
        self._root_key = lambda namespace: root_key(fp, namespace)
        self.tree, self.disk = self.new_tree(), store

    def new_tree(self) -> RadixTree:  # an empty tree keyed like this cache's
        return RadixTree(self.block_size, self._root_key)

    def take_notices(self) -> list[str]:
        """One-line notices about the disk tier (damaged or missing blocks), each once."""
        out, self._notices = self._notices, []
        return out + (self.disk.take_notices() if self.disk is not None else [])

    @classmethod
    def create(
        cls,
        config: CacheConfig,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        devices: Sequence[torch.device | str] | torch.device | str = "cpu",
    ) -> PagedKVCache:
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_token = 2 * n_layers * n_kv_heads * head_dim * itemsize
        manager = BlockManager(
            config.blocks_for(per_token),
            config.block_size,
            n_layers,
            n_kv_heads,
            head_dim,
            dtype,
            devices,
        )
        return cls(manager, config.policy, config.max_exact_entries)

    # ---- lookup ------------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], sid: str | None = None,
               namespace: str = "") -> Lookup:
        """Longest reusable prefix of `tokens` in `namespace`, acquired for the caller (release
        when done).

        Only an exact hit with stored logits covers the whole prompt; any other hit leaves at
        least the last token to compute, since its logits are needed to sample."""
        n = len(tokens)
        entry = self.exact.get(tokens, namespace) if n else None
        disk = 0
        if entry is None and (namespace, tuple(tokens)) in self.saved_exact:
            entry, disk = disk_tier.revive_exact(self, tokens, namespace)
        if entry is not None and entry.logits is not None:
            matched, blocks, source, logits = n, list(entry.blocks), HitSource.EXACT, entry.logits
        else:
            match = self.tree.find_prefix(tokens, namespace)
            resident = match.resident(self.block_size)
            match = self.load(match)
            matched = min(match.matched, max(n - 1, 0))
            blocks = match.blocks[: _ceil_div(matched, self.block_size)]
            disk = max(matched - resident, 0)
            source = HitSource.DISK if disk else HitSource.RADIX if matched else HitSource.MISS
            logits = None
        for block in blocks:
            self.policy.on_access(block)
            block.acquire()
        self._counters = self._counters.plus(
            lookup_tokens=n, hit_tokens=matched, hit_count=int(matched > 0),
            miss_count=int(matched == 0), exact_hits=int(source is HitSource.EXACT),
            disk_hit_tokens=disk, disk_hits=int(disk > 0),
        )
        if sid is not None:
            before = self._sessions.get(sid, SessionCounters())
            self._sessions[sid] = before.after_lookup(matched, n)
        return Lookup(matched, tuple(blocks), source, logits, n, disk)

    def peek(self, tokens: Sequence[int], namespace: str = "") -> int:
        """Cached prefix length, in the pool or on disk, without touching stats, timestamps,
        ref counts or the disk (schedulers)."""
        return self.tree.find_prefix(tokens, namespace).matched

    def load(self, match: PrefixMatch) -> PrefixMatch:
        """`match` with its on-disk blocks loaded back (see `disk_tier.load_match`)."""
        if not match.disk:
            return match
        if self.disk is None:
            raise CacheIntegrityError("blocks on disk without a disk tier")
        out, got = disk_tier.load_match(self.disk, self.manager, self.tree, match, self._evict)
        self._notices.extend(got.notices)
        self._counters = self._counters.plus(disk_loads=len(got.blocks),
                                             disk_failures=int(got.pruned))
        return out

    def gather(self, blocks: Sequence[Block], n_tokens: int) -> list[KV]:
        """Per-layer K/V (1, H, n_tokens, D) for the first n_tokens positions of `blocks`."""
        return self.manager.gather([b.block_id for b in blocks], n_tokens)

    def release(self, blocks: Sequence[Block]) -> None:
        """Give back blocks a lookup, or a store with hold=True, acquired for the caller."""
        for block in blocks:
            block.release()

    def record_attention(self, blocks: Sequence[Block], scores: Sequence[float]) -> None:
        for block, score in zip(blocks, scores, strict=True):
            self.policy.record_attention(block, score)

    # ---- store -------------------------------------------------------------------------------

    def store(
        self,
        tokens: Sequence[int],
        kv_per_layer: Sequence[KV],
        skip_tokens: int,
        logits: torch.Tensor | None = None,
        logits_len: int | None = None,
        sid: str | None = None,
        hold: bool = False,
        namespace: str = "",
    ) -> StoreResult:
        """Cache `tokens` in `namespace`; kv_per_layer holds positions [skip_tokens, len(tokens)),
        each (1, H, len(tokens) - skip_tokens, D). `logits`, if given, are those of position
        logits_len - 1 (default: the last), kept in the exact index. Evicts through the policy
        when the pool is short; past that, stores the longest prefix that fits (complete=False):
        never raises for lack of room. Blocks are the caller's only with hold=True (StoreResult)."""
        bs = self.block_size
        n = len(tokens)
        have = kv_per_layer[0][0].shape[-2] if kv_per_layer else 0
        if have != n - skip_tokens:
            raise ValueError(f"K/V covers {have} positions, expected {n - skip_tokens}")
        found = self.tree.find_prefix(tokens, namespace)
        match = self.load(found)
        # a path still partly on disk (no room to load it) cannot be extended: write nothing
        writable = not found.disk or not self.tree.find_prefix(tokens, namespace).disk
        m = match.matched
        held = list(match.blocks)
        for block in held:  # keep our own path safe from the eviction below
            block.acquire()
        evicted = 0
        path = held
        stored = m
        try:
            # Regions of `tokens`, by position (base = m // bs * bs, the start of m's block):
            #
            #   0                  skip_tokens    base          m               end            n
            #   |-- no K/V given --|              |             |               |              |
            #   |---------- cached: the tree's match -----------|--- written ---|-- no room ---|
            #                                     |-- copied ---|
            #                                     (branch only)   (new blocks)  (complete=False)
            #
            # K/V must cover [m, n), hence skip_tokens <= m; `need` new blocks are allocated.
            # extend (the match ends a leaf edge inside a block): [m, end) fills that block's
            #   `room` free slots first, then the new blocks; nothing is copied.
            # branch (anything else): the new blocks start at base; the first one gets a copy
            #   of [base, m), the head it shares with the matched block, then [m, end).
            if skip_tokens <= m < n and writable:
                extend = match.at_leaf_end and m % bs != 0
                base = m // bs * bs
                room = bs - m % bs if extend else 0
                need = _ceil_div(max(n - m - room, 0), bs) if extend else _ceil_div(n - base, bs)
                if need > self.manager.num_free:
                    evicted = self._evict(need - self.manager.num_free)
                need = min(need, self.manager.num_free)
                end = min(n, (m + room + need * bs) if extend else (base + need * bs))
                if end > m:
                    new = self.manager.allocate(need)
                    keep = held if extend else held[: base // bs]
                    try:
                        self._fill(new, held, extend, base, m, end, skip_tokens, kv_per_layer)
                        self.tree.insert(tokens[:end], keep + new, sid, namespace)
                    except BaseException:  # e.g. Ctrl-C: the new blocks go back, unowned
                        self.release(new)
                        self.manager.free(new)
                        raise
                    self._adopt(new)
                    path = keep + new
                    stored = end
                    self._counters = self._counters.plus(stored_tokens=end - m)
            if logits is not None:
                self._remember(tokens[: n if logits_len is None else logits_len], path, stored,
                               logits, namespace)
        finally:
            for block in held:
                block.release()
        if hold:
            for block in path:
                block.acquire()
        return StoreResult(stored, stored - m, tuple(path), stored == n, evicted)

    def _remember(self, prompt: Sequence[int], path: Sequence[Block], stored: int,
                  logits: torch.Tensor, namespace: str) -> None:
        # only entries with logits are kept: the tree serves every other whole-prompt match
        if len(prompt) <= stored:
            self.exact.put(prompt, list(path[: _ceil_div(len(prompt), self.block_size)]),
                           logits, namespace)

    def _adopt(self, new: list[Block]) -> None:
        """The tree now owns these fresh blocks: without a reference (`hold` takes the
        caller's later), and as just used."""
        for block in new:
            block.release()
            self.policy.on_access(block)

    def _fill(
        self,
        new: list[Block],
        held: list[Block],
        extend: bool,
        base: int,
        m: int,
        end: int,
        skip_tokens: int,
        kv_per_layer: Sequence[KV],
    ) -> None:
        """Write positions [m, end) into the held leaf's last block and/or the new blocks; a
        branch that diverges mid-block first copies the shared head of that block."""
        targets = [held[-1], *new] if extend else new
        if not extend and m > base:
            self.manager.copy_tokens(held[-1], new[0], m - base)
        window = [
            (k[:, :, m - skip_tokens : end - skip_tokens],
             v[:, :, m - skip_tokens : end - skip_tokens])
            for k, v in kv_per_layer
        ]
        self.manager.write([b.block_id for b in targets], m - base, window)

    # ---- eviction ----------------------------------------------------------------------------

    def _evict(
        self,
        n: int,
        rank: Callable[[Block], tuple[float, ...] | None] | None = None,
        spill: bool | None = None,
    ) -> int:
        """Evict up to n blocks in the policy's order; returns how many went. With a disk tier
        (and `spill` not False) each goes to disk and stays in the tree; else it is dropped.

        Candidates are the last resident blocks of nodes without a resident descendant (the
        leaves, without a tier), in one heap; when a node loses its last resident block, its
        parent may become one. Only a merge of a parent with its single remaining child moves
        blocks between nodes, so the heap is rebuilt then.
        """
        rank = rank or self.policy.rank
        to_disk = spill is not False and disk_tier.spills(self.disk)
        tree = self.tree
        done = 0
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
        while done < n and heap:
            _, bid = heapq.heappop(heap)
            node = owner.pop(bid)
            victim = node.blocks[-1]
            parent = node.parent
            merges_before = tree.merges
            self.exact.drop_block(victim)
            # one line per evicted block: a hook that explains later misses fits here
            if to_disk and self.disk is not None:
                disk_tier.spill(self.disk, self.manager, tree, node)
            else:
                tree.pop_block(node)
            self.manager.free([victim])
            done += 1
            if tree.merges != merges_before:
                heap, owner = build()
            elif node.blocks:
                push(heap, owner, node)
            elif candidate(parent):
                assert parent is not None
                push(heap, owner, parent)
        self._counters = self._counters.plus(eviction_count=done,
                                             spilled_blocks=done if to_disk else 0)
        return done

    def evict(self, n: int) -> int:
        return self._evict(n)

    def clear(self) -> int:
        """Drop everything no request is using (first blocks too); returns blocks freed."""
        self.exact.clear()
        freed = self._evict(self.manager.num_blocks, lambda block: (0.0,), spill=False)
        self.tree.drop_disk()
        return freed

    # ---- views -------------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        return CacheStats.build(
            self._counters,
            policy=self.policy.name,
            pool=self.manager.stats(),
            tree_nodes=sum(1 for _ in self.tree.nodes()),
            tree_tokens=self.tree.num_tokens,
            exact_entries=len(self.exact),
            disk_tokens=sum(len(n.tokens) - len(n.blocks) * self.block_size
                            for n, _ in self.tree.nodes() if n.on_disk),
        )

    # ---- state (the snapshot) --------------------------------------------------------------

    def reset(self) -> None:
        """Empty the cache: every block free, tree, exact index and counters new. Blocks that
        callers still hold are freed too, so only call it when no request is running."""
        self.tree = self.new_tree()
        self.exact.clear()
        self.saved_exact.clear()
        self._sessions = {}
        self._counters = Counters(sessions=self._sessions)
        self.manager.reset()

    def restore(self, tree: RadixTree, counters: Counters) -> None:
        """Adopt a tree rebuilt from the index file (its blocks on disk, or already imported
        into this cache's manager) and the counters saved with it."""
        self.tree = tree
        self._sessions = dict(counters.sessions)
        self._counters = replace(counters, sessions=self._sessions)

    def check_integrity(self) -> None:
        """Raise CacheIntegrityError if pool, tree and exact index disagree."""
        from kvchat.cache.integrity import check_cache

        try:
            check_cache(self)
        except AssertionError as exc:
            raise CacheIntegrityError(str(exc)) from exc
