"""Why a prompt's cached prefix ended where it did: it was never seen (cold), it was cached and
evicted (when, by which policy), the cache holds a different continuation (diverged at token
i: a changed date, a reordered system prompt), or it is cached on disk but the pool had no room
to load it back (pool full: running requests held every block).

Torch-free: it walks a RadixTree, the live cache's or one `kvchat inspect` rebuilds from a
snapshot's index, and learns what was evicted from the `Tombstones` (kvchat.cache.tombstones).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from kvchat.cache.visibility import Visibility, preview

if TYPE_CHECKING:
    from kvchat.cache.radix import PrefixMatch, RadixTree
    from kvchat.cache.radix_node import Node
    from kvchat.cache.tombstones import Tombstones

CONTEXT = 8  # tokens shown on each side of a divergence


class MissReason(StrEnum):
    HIT = "hit"  # everything reusable was cached
    COLD = "cold"  # nothing beyond the cached prefix was ever cached
    EVICTED = "evicted"  # what followed was cached, then evicted
    DIVERGED = "diverged"  # the cache continues differently from the prompt
    POOL_FULL = "pool_full"  # cached on disk, but no free pool block to load it back into


@dataclass(frozen=True)
class Explanation:
    reason: MissReason
    cached: int  # leading prompt tokens the cache holds now (pool or disk)
    prompt_tokens: int
    diverged_at: int | None = None  # first prompt token the closest cached sequence lacks
    cached_next: tuple[int, ...] = ()  # what the cache holds from there (a few tokens)
    evicted_through: int | None = None  # the prompt was cached up to here before eviction
    evicted_at: float | None = None  # unix time
    evicted_by: str | None = None  # the eviction policy (or "clear")
    disk_through: int | None = None  # pool full: the prompt is cached on disk up to here

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"miss_reason": self.reason.value,
                               "cached_tokens": self.cached, "diverged_at": self.diverged_at}
        if self.reason is MissReason.EVICTED:
            out.update(evicted_through=self.evicted_through, evicted_at=self.evicted_at,
                       evicted_by=self.evicted_by)
        if self.reason is MissReason.POOL_FULL:
            out.update(disk_through=self.disk_through)
        return out

    def label(self, own_from: int, after_history: bool = False) -> str:
        """`reason` as a person should read it, given where the request's own text starts:
        after its conversation's history (`after_history`), or after the system prompt and
        template header it may share with others. When everything before `own_from` was
        cached, a cold tail is just the new message ("new"), and so is a divergence after a
        history (the cache holds an earlier branch of it: a rewind, a retry); a divergence
        after a shared head is where this request leaves what others sent after the same
        system prompt ("shared prefix"). Programs keep reading `reason`, whose values are
        stable."""
        if self.reason in (MissReason.COLD, MissReason.DIVERGED) and self.cached >= own_from:
            cold = self.reason is MissReason.COLD or after_history
            return "new" if cold else "shared prefix"
        return self.reason.value

    def describe(self, prompt: Sequence[int], decode: Callable[[list[int]], str] | None,
                 visibility: Visibility) -> str:
        """One line for people: where the cached prefix ended and why; a divergence shows a
        few decoded tokens on each side, the cache's text against the prompt's, as far as the
        caller may see them (`kvchat.cache.visibility`: in a shared namespace, only its own)."""
        n, c = self.prompt_tokens, self.cached
        if self.reason is MissReason.HIT:
            return f"all {c} reusable tokens of {n} were cached"
        if self.reason is MissReason.COLD:
            return (f"cold: nothing past token {c} of {n} was ever cached" if c
                    else f"cold: none of the {n} prompt tokens was ever cached")
        if self.reason is MissReason.EVICTED:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.evicted_at or 0))
            return (f"evicted: tokens {c}-{self.evicted_through} of {n} were cached, then "
                    f"evicted by {self.evicted_by} at {when}")
        if self.reason is MissReason.POOL_FULL:
            return (f"pool full: tokens {c}-{self.disk_through} of {n} are cached on disk, but "
                    "running requests held every pool block, so none could be loaded back")
        i = self.diverged_at or 0
        head = preview(prompt[max(i - CONTEXT, 0) : i], decode, visibility, sent=True) or ""
        new = head + (preview(prompt[i : i + CONTEXT], decode, visibility, sent=True) or "")
        theirs = preview(self.cached_next, decode, visibility, sent=False)
        if theirs is None:
            return (f"diverged at token {i} of {n}: new {new!r}; the cache, shared with other "
                    "callers, holds another continuation (not shown)")
        return f"diverged at token {i} of {n}: cached {head + theirs!r} vs new {new!r}"


def explain(tree: RadixTree, prompt: Sequence[int], namespace: str = "",
            tombstones: Tombstones | None = None, exact: bool = False,
            match: PrefixMatch | None = None, served: int | None = None) -> Explanation:
    """Where `prompt`'s cached prefix ends in `namespace` and why. A non-exact hit always
    leaves the last token to compute, so n - 1 cached tokens is a full hit; `exact` says the
    exact index served the whole prompt. `match` is the tree's walk for `prompt`, when the
    caller already made it. `served` is how many leading tokens a lookup actually served (the
    facts its counters come from): a walk that found more, on disk, than could be loaded is
    explained as POOL_FULL from there, never as a hit."""
    n = len(prompt)
    if exact:
        return Explanation(MissReason.HIT, n, n)
    match = match if match is not None else tree.find_prefix(prompt, namespace)
    cached = match.matched
    if served is not None and served < min(cached, n - 1):
        return Explanation(MissReason.POOL_FULL, served, n, disk_through=cached)
    if cached >= n - 1:
        return Explanation(MissReason.HIT, cached, n)
    dead = tombstones.longest(tree, namespace, prompt, cached) if tombstones else None
    if dead is not None:
        through, when, policy = dead
        return Explanation(MissReason.EVICTED, cached, n, evicted_through=through,
                           evicted_at=when, evicted_by=policy)
    after = _held_after(match.node, cached) if cached else ()
    if after:
        return Explanation(MissReason.DIVERGED, cached, n, diverged_at=cached, cached_next=after)
    return Explanation(MissReason.COLD, cached, n)  # nothing in common, or the cache ends there


def _held_after(node: Node | None, pos: int) -> tuple[int, ...]:
    """Up to CONTEXT tokens the tree holds right after absolute position `pos`, where a walk
    ended at `node`: the rest of its edge, then down its first children (empty at a leaf's
    end)."""
    out: list[int] = []
    while node is not None and len(out) < CONTEXT:
        out.extend(node.tokens[max(pos - node.start, 0) : max(pos - node.start, 0) + CONTEXT])
        pos = node.end
        children = node.child_list()
        node = children[0] if children else None
    return tuple(out[:CONTEXT])
