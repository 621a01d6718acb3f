"""What the cache's calls return: a lookup's hit (`Lookup`, with its `HitSource`), what a store
cached (`StoreResult`), and the error its bookkeeping raises when it contradicts itself."""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

    from kvchat.cache.blocks import Block
    from kvchat.cache.explain import Explanation


class CacheIntegrityError(AssertionError):
    """The cache's bookkeeping contradicts itself (a bug, never a user error)."""


class HitSource(StrEnum):
    EXACT = "exact"
    RADIX = "radix"
    DISK = "disk"  # part of the hit was loaded back from the disk tier
    SHARED = "shared"  # part of it came from blocks other instances put in a shared store
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
    why: Explanation | None = None  # where the cached prefix ended, and why (`explain`)
    shared_tokens: int = 0  # of `matched`, tokens from blocks other instances stored (shared)
    reply: tuple[int, ...] = ()  # exact hits: the greedy reply decoded after it (`ExactEntry`)


class StoreResult(NamedTuple):
    """What a store cached. `blocks` cover positions [0, stored). They are acquired for the
    caller only when it passed hold=True (then it releases them); otherwise they are the
    tree's, valid until the next call that mutates the cache (write_kv, evict, clear, reset)."""

    stored: int  # leading tokens of the sequence now cached
    new_tokens: int  # of which this call wrote
    blocks: tuple[Block, ...]
    complete: bool  # False when the pool could not hold the whole sequence
    evicted: int  # blocks evicted to make room
