"""The cache's statistics: one set of types and one JSON schema for every view of them.

`PagedKVCache.stats()` returns a `CacheStats`; the chat panels, `kvchat inspect` (text and
`--json`), the server's `/cache/stats` and `/cache/tree`, and the snapshot's "counters" all use
it. Plain Python only: `kvchat inspect` builds one from index.json without importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any


def ratio(num: float, den: float) -> float:
    """num / den, and 0.0 when nothing was counted: the one definition of every rate here."""
    return num / den if den else 0.0


@dataclass(frozen=True)
class SessionCounters:
    """One session's lookups and how many of its prompt tokens the cache served."""

    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return ratio(self.hit_tokens, self.prompt_tokens)

    def after_lookup(self, matched: int, prompt_tokens: int) -> SessionCounters:
        return SessionCounters(
            self.lookups + 1,
            self.hits + bool(matched),
            self.prompt_tokens + prompt_tokens,
            self.hit_tokens + matched,
        )

    def to_json(self) -> dict[str, Any]:
        return {"lookups": self.lookups, "hits": self.hits, "prompt_tokens": self.prompt_tokens,
                "hit_tokens": self.hit_tokens, "hit_rate": self.hit_rate}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SessionCounters:
        return cls(int(data["lookups"]), int(data["hits"]), int(data["prompt_tokens"]),
                   int(data["hit_tokens"]))


@dataclass(frozen=True)
class PoolStats:
    """Occupancy of the block pool. total_blocks (and bytes_per_block) are None for a snapshot
    written before kvchat recorded the pool's size; free blocks and utilisation are then unknown."""

    block_size: int
    total_blocks: int | None
    used_blocks: int
    bytes_per_block: int | None = None

    @property
    def free_blocks(self) -> int | None:
        return None if self.total_blocks is None else self.total_blocks - self.used_blocks

    @property
    def utilisation(self) -> float | None:
        return None if self.total_blocks is None else ratio(self.used_blocks, self.total_blocks)

    @property
    def capacity_tokens(self) -> int | None:
        return None if self.total_blocks is None else self.total_blocks * self.block_size

    def to_json(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "total_blocks": self.total_blocks,
                "used_blocks": self.used_blocks, "free_blocks": self.free_blocks,
                "utilisation": self.utilisation, "bytes_per_block": self.bytes_per_block}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PoolStats:
        total, per_block = data.get("total_blocks"), data.get("bytes_per_block")
        return cls(
            block_size=int(data["block_size"]),
            total_blocks=None if total is None else int(total),
            used_blocks=int(data["used_blocks"]),
            bytes_per_block=None if per_block is None else int(per_block),
        )


@dataclass(frozen=True, kw_only=True)
class Counters:
    """What the cache counts as it runs; the snapshot keeps these (as "counters") across
    restarts. Hits are lookups that matched at least one token."""

    hit_count: int = 0
    miss_count: int = 0
    exact_hits: int = 0
    hit_tokens: int = 0
    lookup_tokens: int = 0
    eviction_count: int = 0
    stored_tokens: int = 0
    disk_hits: int = 0  # lookups whose hit was (partly) loaded from the disk tier
    disk_hit_tokens: int = 0  # of hit_tokens, those loaded from disk
    disk_loads: int = 0  # blocks read back from disk
    disk_failures: int = 0  # blocks on disk that could not be served (pruned)
    spilled_blocks: int = 0  # evicted blocks written to disk instead of dropped
    shared_hits: int = 0  # lookups whose hit was (partly) other instances' blocks
    shared_hit_tokens: int = 0  # of hit_tokens, those from a shared store (`shared_tier`)
    sessions: Mapping[str, SessionCounters] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return ratio(self.hit_count, self.hit_count + self.miss_count)

    @property
    def token_hit_rate(self) -> float:
        return ratio(self.hit_tokens, self.lookup_tokens)

    def plus(self, **deltas: int) -> Counters:
        """A copy with the named counts raised (sessions are shared, not copied)."""
        return replace(self, **{name: getattr(self, name) + n for name, n in deltas.items()})

    def counters_json(self) -> dict[str, Any]:
        """The snapshot's "counters" object."""
        out: dict[str, Any] = {name: getattr(self, name) for name in _COUNTS}
        # the counts alone, as index.json has always held them (rates are derived)
        out["sessions"] = {sid: asdict(s) for sid, s in sorted(self.sessions.items())}
        return out

    @classmethod
    def counters_from_json(cls, data: Mapping[str, Any]) -> Counters:
        """Inverse of counters_json; a count an older snapshot did not record reads as 0."""
        sessions = {str(sid): SessionCounters.from_json(s)
                    for sid, s in dict(data.get("sessions", {})).items()}
        counts: dict[str, Any] = {name: int(data.get(name, 0)) for name in _COUNTS}
        return replace(Counters(sessions=sessions), **counts)


_COUNTS = tuple(f.name for f in fields(Counters) if f.name != "sessions")


@dataclass(frozen=True, kw_only=True)
class CacheStats(Counters):
    """The counters with the state of the pool, the radix tree and the exact index: a copy,
    later cache activity does not change it. tree_tokens are the tokens the tree caches."""

    policy: str
    pool: PoolStats
    tree_nodes: int
    tree_tokens: int
    exact_entries: int
    disk_tokens: int = 0  # of tree_tokens, those only on disk

    @property
    def memory_hit_tokens(self) -> int:
        return self.hit_tokens - self.disk_hit_tokens - self.shared_hit_tokens

    @property
    def counters(self) -> Counters:
        return replace(Counters(sessions=self.sessions),
                       **{name: getattr(self, name) for name in _COUNTS})

    def to_json(self) -> dict[str, Any]:
        """The schema of `/cache/stats` and of "stats" in `kvchat inspect --json`."""
        counts = self.counters_json()
        del counts["sessions"]
        return {
            "policy": self.policy,
            **counts,
            "hit_rate": self.hit_rate,
            "token_hit_rate": self.token_hit_rate,
            "tree_nodes": self.tree_nodes,
            "tree_tokens": self.tree_tokens,
            "exact_entries": self.exact_entries,
            "disk_tokens": self.disk_tokens,
            "sessions": {sid: s.to_json() for sid, s in sorted(self.sessions.items())},
            "pool": {**self.pool.to_json(), "cached_tokens": self.tree_tokens},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CacheStats:
        """Inverse of to_json (the rates and other derived fields are recomputed)."""
        return cls.build(
            Counters.counters_from_json(data),
            policy=str(data["policy"]),
            pool=PoolStats.from_json(data["pool"]),
            tree_nodes=int(data["tree_nodes"]),
            tree_tokens=int(data["tree_tokens"]),
            exact_entries=int(data["exact_entries"]),
            disk_tokens=int(data.get("disk_tokens", 0)),
        )

    @classmethod
    def build(
        cls,
        counters: Counters,
        *,
        policy: str,
        pool: PoolStats,
        tree_nodes: int,
        tree_tokens: int,
        exact_entries: int,
        disk_tokens: int = 0,
    ) -> CacheStats:
        """The counters with the pool, tree and exact-index state beside them."""
        stats = cls(sessions=dict(counters.sessions), policy=policy, pool=pool,
                    tree_nodes=tree_nodes, tree_tokens=tree_tokens, exact_entries=exact_entries,
                    disk_tokens=disk_tokens)
        return replace(stats, **{name: getattr(counters, name) for name in _COUNTS})
