"""PagedKVCache: the facade the engine talks to (lookup, gather, write_kv, release, stats).

Lookup is two-layer: the exact index first (whole prompt, with its last logits: no forward pass
needed), then the radix tree (longest cached prefix, token-granular). write_kv evicts leaf blocks
through the policy when the pool is short, writes the new K/V, and registers the sequence in both
layers. Blocks a lookup (or a write_kv with hold=True) hands out are acquired; the caller releases
them when its request ends. Blocks the tree owns carry no reference.

With a disk tier (a BlockStore, `use_store`), eviction spills a block to disk instead of
dropping it: the tree keeps its node, tokens and key, and a lookup that reaches it loads it back
(a disk hit, HitSource.DISK). Without one, evicted blocks leave the tree as before. A store
other instances share also serves blocks this tree never held (`shared_tier`: HitSource.SHARED).

Every lookup, peek and store names a namespace ("" by default): entries stored in one are never
a hit in another, so callers that must not learn of each other's prompts (a server's tenants)
share the pool but no blocks. Eviction ranks all namespaces' blocks together.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from kvchat.cache import disk_tier, shared_tier
from kvchat.cache.block_keys import root_key
from kvchat.cache.blocks import KV, Block, BlockManager, fill_span
from kvchat.cache.drafts import continuation
from kvchat.cache.eviction import EvictionPolicy, Rank, evict_leaves, make_policy
from kvchat.cache.exact import ExactIndex
from kvchat.cache.explain import Explanation, explain
from kvchat.cache.integrity import check_cache
from kvchat.cache.lookup import CacheIntegrityError, HitSource, Lookup, StoreResult
from kvchat.cache.pins import DEFAULT_MAX_PINNED, Pin, PinError, PinTable, pin_prefix
from kvchat.cache.radix import PrefixMatch, RadixTree
from kvchat.cache.state import (
    CacheState,
    SavedPin,
    SnapshotMismatch,
    exact_to_save,
    graft,
    records_of,
)
from kvchat.cache.stats import CacheStats, Counters, SessionCounters
from kvchat.cache.tombstones import Tombstones
from kvchat.config import CacheConfig

if TYPE_CHECKING:
    from kvchat.cache.block_backend import BlockBackend


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCache:
    def __init__(
        self,
        manager: BlockManager,
        policy: EvictionPolicy | str | None = None,
        max_exact_entries: int = 256,
        max_pinned: float = DEFAULT_MAX_PINNED,
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
        self.disk: BlockBackend | None = None
        self._root_key: Callable[[str], str] | None = None
        self._notices: list[str] = []
        self.pins = PinTable(manager.num_blocks, max_pinned)
        self.tombstones = Tombstones()  # evicted blocks, for `explain`

    def use_store(self, store: BlockBackend | None, fingerprint: Mapping[str, Any]) -> None:
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

    def notice(self, line: str) -> None:
        self._notices.append(line)

    def take_notices(self) -> list[str]:
        """One-line notices about the disk tier (damaged or missing blocks), each once."""
        out, self._notices = self._notices, []
        return out + (self.disk.take_notices() if self.disk is not None else [])

    @classmethod
    def create(cls, config: CacheConfig, n_layers: int, n_kv_heads: int, head_dim: int,
               dtype: torch.dtype = torch.float32,
               devices: Sequence[torch.device | str] | torch.device | str = "cpu",
               ) -> PagedKVCache:
        manager = BlockManager.for_config(config, n_layers, n_kv_heads, head_dim, dtype, devices)
        return cls(manager, config.policy, config.max_exact_entries, config.max_pinned)

    # ---- lookup ------------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], sid: str | None = None,
               namespace: str = "") -> Lookup:
        """Longest reusable prefix of `tokens` in `namespace`, acquired for the caller (release
        when done).

        Only an exact hit with stored logits covers the whole prompt; any other hit leaves at
        least the last token to compute, since its logits are needed to sample."""
        n = len(tokens)
        entry = self.exact.get(tokens, namespace) if n else None
        disk = shared = 0
        if entry is None and self.exact.is_saved(tokens, namespace):
            entry, disk = self.exact.revive(tokens, namespace, self.tree, self.load)
        if entry is not None and entry.logits is not None:
            matched, blocks, source, logits = n, list(entry.blocks), HitSource.EXACT, entry.logits
            reply = entry.reply
            why = explain(self.tree, tokens, exact=True)
        else:
            found = self.tree.find_prefix(tokens, namespace)
            resident = found.resident(self.block_size)
            match = self.load(found)
            own = match.matched
            cut = own < found.matched  # a block lost on disk: the tree was pruned
            if not cut and shared_tier.active(self):
                match, shared = shared_tier.extend(self, tokens, namespace, match)
            # the walk explains the miss from what was served: when loading cut the match or the
            # shared tier extended it, the tree is walked again; what it still holds on disk
            # past the match had no room in the pool (POOL_FULL)
            again = cut or match.matched > own
            why = explain(self.tree, tokens, namespace, self.tombstones,
                          match=None if again else found, served=match.matched)
            matched = min(match.matched, max(n - 1, 0))
            blocks = match.blocks[: _ceil_div(matched, self.block_size)]
            disk, shared = max(min(matched, own) - resident, 0), max(matched - own, 0)
            source = (HitSource.SHARED if shared else HitSource.DISK if disk
                      else HitSource.RADIX if matched else HitSource.MISS)
            logits, reply = None, ()
        for block in blocks:
            self.policy.on_access(block)
            block.acquire()
        self._counters = self._counters.plus(
            lookup_tokens=n, hit_tokens=matched, hit_count=int(matched > 0),
            miss_count=int(matched == 0), exact_hits=int(source is HitSource.EXACT),
            disk_hit_tokens=disk, disk_hits=int(disk > 0), shared_hit_tokens=shared,
            shared_hits=int(shared > 0),
        )
        if sid is not None:
            before = self._sessions.get(sid, SessionCounters())
            self._sessions[sid] = before.after_lookup(matched, n)
        return Lookup(matched, tuple(blocks), source, logits, n, disk, why, shared, reply)

    def peek(self, tokens: Sequence[int], namespace: str = "") -> int:
        """Cached prefix length, in the pool or on disk, without touching stats, timestamps,
        ref counts or the disk (schedulers)."""
        return self.tree.find_prefix(tokens, namespace).matched

    def draft(self, tokens: Sequence[int], namespace: str = "", k: int = 8) -> list[int]:
        """Up to k tokens the tree holds after `tokens` (`drafts.continuation`), read like
        `peek`: nothing changes."""
        return continuation(self.tree, tokens, namespace, k)

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
        """Give back blocks a lookup, or a write_kv with hold=True, acquired for the caller."""
        for block in blocks:
            block.release()

    def record_attention(self, blocks: Sequence[Block], scores: Sequence[float]) -> None:
        for block, score in zip(blocks, scores, strict=True):
            self.policy.record_attention(block, score)

    # ---- write_kv ----------------------------------------------------------------------------

    def write_kv(
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
                        fill_span(self.manager, new, held, extend, (base, m, end), skip_tokens,
                                  kv_per_layer)
                        self.tree.insert(tokens[:end], keep + new, sid, namespace)
                    except BaseException:  # e.g. Ctrl-C: the new blocks go back, unowned
                        self.release(new)
                        self.manager.free(new)
                        raise
                    self._adopt(new)
                    path, stored = keep + new, end
                    self._counters = self._counters.plus(stored_tokens=end - m)
                    shared_tier.write_through(self, tokens[:end], path, m // bs, namespace)
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
        """The tree now owns these fresh blocks, unreferenced (hold takes its own), just used."""
        for block in new:
            block.release()
            self.policy.on_access(block)

    # ---- eviction ----------------------------------------------------------------------------

    def _evict(self, n: int, rank: Rank | None = None, spill: bool | None = None,
               why: str | None = None) -> int:
        """Evict up to n unpinned blocks, leaf first (`eviction.evict_leaves`); returns how
        many went."""
        done = evict_leaves(self, n, rank, spill, why)
        self._counters = self._counters.plus(eviction_count=done.taken,
                                             spilled_blocks=done.spilled)
        return done.taken

    def evict(self, n: int) -> int:  # the policy's order, pins kept
        return self._evict(n)

    def clear(self) -> int:
        """Drop everything no request is using (first blocks and pins too); returns blocks
        freed."""
        self.exact.clear()
        self.pins.clear()
        for node, _ in list(self.tree.nodes()):  # what is only on disk goes too
            if node.on_disk and (node.parent is None or not node.parent.on_disk):
                self.tombstones.record_subtree(self.tree, node, len(node.blocks), "clear")
        freed = self._evict(self.manager.num_blocks, lambda b: (0.0,), spill=False, why="clear")
        self.tree.drop_disk()
        return freed

    # ---- pins and explanations ------------------------------------------------------------

    def pin(self, tokens: Sequence[int], namespace: str = "", label: str = "prefix") -> Pin:
        """Keep the blocks of the cached prefix `tokens` in the pool (`pins.pin_prefix`)."""
        return pin_prefix(self, tokens, namespace, label)

    def unpin(self, pin_id: str) -> Pin | None:
        """End a pin (`Pin.pin_id`); its blocks become evictable again. None if unknown."""
        return self.pins.remove(pin_id)

    def explain(self, tokens: Sequence[int], namespace: str = "",
                exact: bool = False) -> Explanation:
        """Where `tokens`' cached prefix ends and why (hit, cold, evicted, diverged), before they
        are stored. Touches no stats, timestamps or ref counts."""
        return explain(self.tree, tokens, namespace, self.tombstones, exact)

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
        self.pins.clear()
        self.tombstones = Tombstones(self.tombstones.capacity)
        self._sessions = {}
        self._counters = Counters(sessions=self._sessions)
        self.manager.reset()

    def persist(self) -> None:
        """Make the disk tier (if any) hold every block of the tree, on disk when this returns;
        blocks it evicted to stay in budget leave the tree, remembered as tombstones ("disk
        budget"). A CacheState exported after it names only blocks the tier can serve."""
        if self.disk is not None and self.disk.enabled:
            tree = self.tree
            disk_tier.persist(self.disk, self.manager, tree, lambda node, first:
                              self.tombstones.record_subtree(tree, node, first, "disk budget"))

    def export(self) -> CacheState:
        """This cache's state as plain data: the tree's records (tokens, block keys, owners,
        pins), counters, the policy's state, pins, tombstones and the exact entries worth
        saving. No K/V: `persist` first, so the disk tier holds every block the records name."""
        mgr, stats = self.manager, self.stats()
        return CacheState(
            block_size=self.block_size,
            shape=(mgr.n_layers, mgr.n_kv_heads, mgr.head_dim),
            policy=self.policy.name,
            policy_state=self.policy.state(),
            tree=records_of(self.tree, self.pins.block_ids),
            counters=replace(self._counters, sessions=dict(self._sessions)),
            pins=tuple(SavedPin(p.namespace, tuple(p.tokens), p.label) for p in self.pins),
            tombstones=self.tombstones.rows(),
            exact=exact_to_save(self.tree, self.exact),
            resident_blocks=mgr.num_blocks - mgr.num_free,
            disk_tokens=stats.disk_tokens,
        )

    def restore(self, state: CacheState,
                logits: Callable[[str], Any] = lambda name: None) -> None:
        """Rebuild an exported state in this empty cache, every block on disk (loaded on its
        first hit); exact entries wait until first hit, when `logits(name)` reads theirs. Pins
        are made again (a pin that no longer fits is dropped with a notice). Raises
        SnapshotMismatch if the state does not fit or hold together, leaving the cache empty."""
        try:
            mgr = self.manager
            if state.block_size != self.block_size:
                raise SnapshotMismatch("block size differs")
            if tuple(state.shape) != (mgr.n_layers, mgr.n_kv_heads, mgr.head_dim):
                raise SnapshotMismatch("K/V shape differs")
            if mgr.num_free != mgr.num_blocks:
                raise SnapshotMismatch("the cache is not empty")
            self.tree = graft(self.new_tree(), state.tree)
            self._sessions = dict(state.counters.sessions)
            self._counters = replace(state.counters, sessions=self._sessions)
            self.policy.restore(state.policy_state)
            self.tombstones = Tombstones(self.tombstones.capacity)
            for key, prev, tokens, when, policy in state.tombstones:
                self.tombstones.record(key, prev, tokens, policy, when)
            for e in state.exact:
                self.exact.save(e.tokens, e.namespace, functools.partial(logits, e.logits),
                                e.reply, e.row)
            self.check_integrity()
        except SnapshotMismatch:
            self.reset()
            raise
        except (ValueError, AssertionError) as exc:
            self.reset()
            raise SnapshotMismatch(f"the index is damaged ({type(exc).__name__}: {exc})"
                                   ) from exc
        for pin in state.pins:
            try:
                self.pin(pin.tokens, pin.namespace, pin.label)
            except PinError as exc:
                self.notice(f"A saved pin ({pin.label}, {len(pin.tokens)} tokens) was dropped: "
                            f"{exc}")

    def check_integrity(self) -> None:
        """Raise CacheIntegrityError if pool, tree and exact index disagree."""
        try:
            check_cache(self.manager, self.tree, self.exact, self.pins, self.disk is not None)
        except AssertionError as exc:
            raise CacheIntegrityError(str(exc)) from exc
