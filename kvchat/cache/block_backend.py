"""BlockBackend: what the cache needs from the tier below the pool, whatever holds the blocks.

The contract of every backend (the folder `store.BlockStore`, Redis/Valkey `redis_store.
RedisStore`), as SGLang's HiCache storage and LMCache's remote backends have it: a block is put,
tested and read by its key (`block_keys`: model fingerprint + namespace + every token through the
block, so a key never names two contents), and its bytes are `block_file`'s, checksummed and
verified on every read.

- `put` never blocks on the store for long and never raises for the store's sake: a store that
  is down or full drops the block (the cache still holds it, or recomputes it later).
- `get` returns a typed `ReadResult`; a block that is missing, damaged, or on a store that does
  not answer is a miss with at most a one-line notice, never an exception.
- `exists` may answer True for a block that a later `get` misses (another process evicted it
  meanwhile); callers handle that miss as any other.
- `shared`: other kvchat instances put blocks here too, so a key this instance's tree does not
  know may still be found (`shared_tier`), and computed blocks are written through at once.

Plain Python: no torch import (the backends import it where they build tensors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

    from kvchat.cache.block_file import BlockKV, BlockLayout


class ReadStatus(StrEnum):
    HIT = "hit"
    MISSING = "missing"  # no such block, or its file vanished or could not be opened
    CORRUPT = "corrupt"  # the file failed its checks: quarantined, never served


class ReadResult(NamedTuple):
    """A `get`: on a hit, the block's tokens and per-layer (K, V), each (H, block_size, D) on the
    CPU in the store's dtype, positions from len(tokens) on zero. `notice` is one line for the
    user when something went wrong beyond a plain miss."""

    kv: BlockKV | None
    status: ReadStatus
    tokens: tuple[int, ...] = ()
    notice: str | None = None


@dataclass(frozen=True)
class StoreStats:
    blocks: int
    bytes: int
    budget_bytes: int
    writes: int = 0  # files this store wrote
    reads: int = 0  # hits served (from a file or from the write queue)
    read_failures: int = 0  # files that failed their checks
    write_failures: int = 0
    evictions: int = 0  # files deleted to stay under the budget
    pending: int = 0  # blocks queued, not yet on disk

    def to_json(self) -> dict[str, int]:
        return asdict(self)


class BlockBackend(Protocol):
    layout: BlockLayout
    budget_bytes: int
    shared: bool

    @property
    def enabled(self) -> bool:
        """False when the tier is off (a zero budget): puts are dropped, gets miss."""
        ...

    def put(self, key: str, tokens: Sequence[int],
            kv: Sequence[tuple[torch.Tensor, torch.Tensor]], wait: bool = True) -> bool:
        """Queue one block (1..block_size tokens and per layer (K, V)), copied before it
        returns; whether a write was queued. `wait=False`: drop it rather than wait when the
        write queue is full."""
        ...

    def exists(self, key: str) -> bool:
        ...

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first on, the store holds (it stops at the first
        missing one): the blocks of a prefix, in one round trip where the store allows."""
        ...

    def get(self, key: str) -> ReadResult:
        ...

    def flush(self) -> None:
        """Wait until every queued block is written (or dropped)."""
        ...

    def close(self) -> None:
        ...

    def take_notices(self) -> list[str]:
        """One-line notices (a store gone, damaged blocks), each returned once."""
        ...

    def stats(self) -> StoreStats:
        ...

    def describe(self) -> str:
        """Where the blocks live, for people: a folder, or a Redis URL without its password."""
        ...
