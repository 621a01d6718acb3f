"""Why a prompt's cached prefix ended where it did: it was never seen (cold), it was cached and
evicted (when, by which policy), or the cache holds a different continuation (diverged at token
i: a changed date, a reordered system prompt).

Torch-free: it walks either the live radix tree or the views `kvchat inspect` builds from a
snapshot, through the two things both have, `.tokens` and `.children`.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol


class MissReason(StrEnum):
    HIT = "hit"  # everything reusable was cached
    COLD = "cold"  # nothing beyond the cached prefix was ever cached
    EVICTED = "evicted"  # what followed was cached, then evicted
    DIVERGED = "diverged"  # the cache continues differently from the prompt


class TreeNode(Protocol):
    tokens: Any
    children: Any


@dataclass(frozen=True)
class Explanation:
    reason: MissReason
    cached: int  # leading prompt tokens the cache holds now
    prompt_tokens: int
    diverged_at: int | None = None  # first prompt token the closest cached sequence lacks
    cached_next: tuple[int, ...] = ()  # what the cache holds from there (a few tokens)
    evicted_through: int | None = None  # the prompt was cached up to here before eviction
    evicted_at: float | None = None  # unix time
    evicted_by: str | None = None  # the eviction policy

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"miss_reason": self.reason.value,
                               "cached_tokens": self.cached, "diverged_at": self.diverged_at}
        if self.reason is MissReason.EVICTED:
            out.update(evicted_through=self.evicted_through, evicted_at=self.evicted_at,
                       evicted_by=self.evicted_by)
        return out


class Tombstones:
    """A bounded memory of evicted prefixes (a digest of the tokens through each evicted
    block, oldest forgotten first), so a miss can say "evicted" instead of "cold"."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._dead: OrderedDict[tuple[str, int, str], tuple[float, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._dead)

    def record(self, namespace: str, tokens: Sequence[int], policy: str,
               when: float | None = None) -> None:
        key = (namespace, len(tokens), _digest(tokens))
        self._dead[key] = (time.time() if when is None else when, policy)
        self._dead.move_to_end(key)
        while len(self._dead) > self.capacity:
            self._dead.popitem(last=False)

    def forget(self, namespace: str, tokens: Sequence[int]) -> None:
        """The prefix is cached again."""
        self._dead.pop((namespace, len(tokens), _digest(tokens)), None)

    def longest(self, namespace: str, prompt: Sequence[int], start: int
                ) -> tuple[int, float, str] | None:
        """The longest prefix of `prompt`, past `start` tokens, that was evicted."""
        lengths = {n for ns, n, _ in self._dead if ns == namespace and start < n <= len(prompt)}
        if not lengths:
            return None
        found = None
        running = hashlib.sha256()
        for i, tok in enumerate(prompt[: max(lengths)], start=1):
            running.update(int(tok).to_bytes(8, "little", signed=True))
            if i in lengths:
                hit = self._dead.get((namespace, i, running.hexdigest()))
                if hit is not None:
                    found = (i, *hit)
        return found

    def to_json(self) -> list[list[Any]]:
        return [[ns, n, d, t, p] for (ns, n, d), (t, p) in self._dead.items()]

    @classmethod
    def from_json(cls, rows: Iterable[Sequence[Any]], capacity: int = 4096) -> Tombstones:
        out = cls(capacity)
        for ns, n, d, t, p in rows:
            out._dead[(str(ns), int(n), str(d))] = (float(t), str(p))
        return out


def _digest(tokens: Sequence[int]) -> str:
    h = hashlib.sha256()
    for tok in tokens:
        h.update(int(tok).to_bytes(8, "little", signed=True))
    return h.hexdigest()


def _kids(node: TreeNode) -> Iterable[TreeNode]:
    children = node.children
    return children.values() if isinstance(children, Mapping) else children


def walk_prompt(roots: Iterable[TreeNode], prompt: Sequence[int]
                ) -> tuple[int, tuple[int, ...]]:
    """How many leading tokens of `prompt` the tree holds, and what the tree holds right after
    them on the closest path (empty when the cache ends there)."""
    pos, level = 0, list(roots)
    while pos < len(prompt):
        child = next((c for c in level if len(c.tokens) and c.tokens[0] == prompt[pos]), None)
        if child is None:
            return pos, tuple(next(iter(level)).tokens[:8]) if level else ()
        edge = child.tokens
        i = 0
        while i < len(edge) and pos < len(prompt) and edge[i] == prompt[pos]:
            i, pos = i + 1, pos + 1
        if i < len(edge):
            return pos, tuple(edge[i : i + 8])
        level = list(_kids(child))
    return pos, ()


def explain(prompt: Sequence[int], roots: Iterable[TreeNode], namespace: str = "",
            tombstones: Tombstones | None = None, exact: bool = False) -> Explanation:
    """Where `prompt`'s cached prefix ends and why. `roots` are the top nodes of `namespace`
    (a non-exact hit always leaves the last token to compute, so n - 1 cached is a full hit)."""
    n = len(prompt)
    cached, after = walk_prompt(roots, prompt)
    if exact or cached >= n - 1:
        return Explanation(MissReason.HIT, cached if not exact else n, n)
    dead = tombstones.longest(namespace, prompt, cached) if tombstones is not None else None
    if dead is not None:
        through, when, policy = dead
        return Explanation(MissReason.EVICTED, cached, n, evicted_through=through,
                           evicted_at=when, evicted_by=policy)
    if after and cached:  # nothing in common at all is cold, not a divergence at token 0
        return Explanation(MissReason.DIVERGED, cached, n, diverged_at=cached, cached_next=after)
    return Explanation(MissReason.COLD, cached, n)
