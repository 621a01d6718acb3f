"""Exact-match index: whole prompt -> its blocks and, when given, the last position's logits.

With stored logits an exact repeat samples its first token without any forward pass. Entries die
with any of their blocks (`drop_block`) and the index keeps at most `max_entries` (oldest out
first), because each logits row is vocabulary-sized.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvchat.cache.blocks import Block

Key = tuple[int, ...]


class _HashedKey(tuple[int, ...]):
    """A token tuple that hashes its tokens once. The reverse map holds each prompt's key once per
    block; a plain tuple re-hashes every token at each of those set operations, which made put
    and eviction quadratic in the prompt length."""

    _hash: int

    def __new__(cls, tokens: Sequence[int]) -> _HashedKey:
        self = super().__new__(cls, tokens)
        self._hash = tuple.__hash__(self)
        return self

    def __hash__(self) -> int:
        return self._hash


@dataclass
class ExactEntry:
    blocks: list[Block]  # covering positions [0, len(key))
    logits: Any = None  # the last position's logits row (a tensor), or None


class ExactIndex:
    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[Key, ExactEntry] = OrderedDict()
        self._by_block: dict[int, set[Key]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, tokens: Sequence[int]) -> ExactEntry | None:
        key = tuple(tokens)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, tokens: Sequence[int], blocks: Sequence[Block], logits: Any = None) -> None:
        if self.max_entries == 0:
            return
        key = _HashedKey(tokens)
        self._discard(key)
        self._entries[key] = ExactEntry(list(blocks), logits)
        for block in blocks:
            self._by_block.setdefault(block.block_id, set()).add(key)
        while len(self._entries) > self.max_entries:
            self._discard(next(iter(self._entries)))

    def drop_block(self, block: Block) -> int:
        """Forget every entry that reads this block; returns how many went."""
        keys = self._by_block.pop(block.block_id, set())
        for key in keys:
            self._discard(key)
        return len(keys)

    def _discard(self, key: Key) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        for block in entry.blocks:
            keys = self._by_block.get(block.block_id)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_block[block.block_id]

    def clear(self) -> None:
        self._entries.clear()
        self._by_block.clear()

    def items(self) -> Iterator[tuple[Key, ExactEntry]]:
        return iter(self._entries.items())

    def check(self, block_size: int) -> None:
        for key, entry in self._entries.items():
            assert len(entry.blocks) == -(-len(key) // block_size), "exact entry block count"
            joined = [t for b in entry.blocks for t in b.token_ids][: len(key)]
            assert tuple(joined) == key, "exact entry blocks no longer hold its tokens"
            for block in entry.blocks:
                assert key in self._by_block.get(block.block_id, ()), "reverse map out of date"
        for bid, keys in self._by_block.items():
            for key in keys:
                # assert, not index: a stale key must fail as an integrity error, not a KeyError
                found = self._entries.get(key)
                assert found is not None, "reverse map names a dropped entry"
                assert any(b.block_id == bid for b in found.blocks), "stale reverse map"
