"""Exact-match index: (namespace, whole prompt) -> its blocks and, when given, the last
position's logits. A prompt cached in one namespace is unknown in every other.

With stored logits an exact repeat samples its first token without any forward pass. Entries die
with any of their blocks (`drop_block`) and the index keeps at most `max_entries` (oldest out
first), because each logits row is vocabulary-sized.

Entries whose blocks are not in the pool wait as saved entries, each with a loader of its
logits: those an earlier process saved (read from its file on first hit) and those parked when
a block spilled to the disk tier (`park`: the row stays in memory). The cache makes one live
again when its prompt is looked up and its path loads back (`revive`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvchat.cache.blocks import Block
    from kvchat.cache.radix import PrefixMatch, RadixTree

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


# (namespace, tokens): both parts hash once (str caches its hash, _HashedKey its own)
NamespacedKey = tuple[str, Key]


class HeldLogits:
    """The loader of a parked exact entry: its logits row, still in memory."""

    def __init__(self, row: Any) -> None:
        self.row = row

    def __call__(self) -> Any:
        return self.row


@dataclass
class ExactEntry:
    blocks: list[Block]  # covering positions [0, len(key))
    logits: Any = None  # the last position's logits row (a tensor), or None
    namespace: str = ""
    # the greedy reply decoded after the prompt from `logits` (each token the argmax after the
    # ones before it), longest seen (`remember_reply`); saved and parked with the logits
    reply: tuple[int, ...] = ()
    digest: str = field(default="", repr=False)  # of `logits`, once a save asks (`row_of`)

    def row_of(self) -> str:
        """The digest of this entry's logits row (`row_digest`), computed once."""
        if not self.digest and self.logits is not None:
            self.digest = row_digest(self.logits)
        return self.digest


def row_digest(row: Any) -> str:
    """A digest of a logits row's bits: what a saved reply names as the row it began from, so
    that a restart pairs it with that row only."""
    import torch

    data = row.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:32]


def _same_row(a: Any, b: Any) -> bool:
    """Whether two logits rows (tensors) hold the same bits."""
    if a is b:
        return a is not None
    try:
        return a is not None and b is not None and a.dtype == b.dtype and bool(a.equal(b))
    except (AttributeError, RuntimeError, TypeError):
        return False


class ExactIndex:
    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[NamespacedKey, ExactEntry] = OrderedDict()
        self._by_block: dict[int, set[NamespacedKey]] = {}
        # (namespace, tokens) -> a loader of its logits (None when they cannot be read)
        self._saved: dict[NamespacedKey, Callable[[], Any]] = {}
        # of saved entries, if any: the reply and the digest of the row it began from ("" for
        # a parked entry, whose row is the very one in memory)
        self._replies: dict[NamespacedKey, tuple[tuple[int, ...], str]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens: object) -> bool:
        """Whether this token tuple is an entry of namespace "" (see `has` for the others)."""
        return isinstance(tokens, tuple) and ("", tokens) in self._entries

    def has(self, tokens: Sequence[int], namespace: str = "") -> bool:
        return (namespace, tuple(tokens)) in self._entries

    def get(self, tokens: Sequence[int], namespace: str = "") -> ExactEntry | None:
        key = (namespace, tuple(tokens))
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, tokens: Sequence[int], blocks: Sequence[Block], logits: Any = None,
            namespace: str = "") -> None:
        if self.max_entries == 0:
            return
        key = (namespace, _HashedKey(tokens))
        old = self._entries.get(key)
        # the prompt stored again (a repeat that decoded): its reply stays, where the logits
        # are the same bits as those the reply began from
        reply = old.reply if old is not None and _same_row(old.logits, logits) else ()
        self._discard(key)
        self._entries[key] = ExactEntry(list(blocks), logits, namespace, reply)
        for block in blocks:
            self._by_block.setdefault(block.block_id, set()).add(key)
        while len(self._entries) > self.max_entries:
            self._discard(next(iter(self._entries)))

    def remember_reply(self, tokens: Sequence[int], namespace: str, reply: Sequence[int],
                       logits: Any) -> bool:
        """Keep `reply`, a greedy reply decoded after the prompt `tokens` from the logits row
        `logits`, with the prompt's entry, if it still has one and holds those very logits;
        the longer of two is kept. Two replies of one prompt agree where both run (the forward
        is batch-invariant); False, and the entry keeps none, when they do not."""
        entry = self._entries.get((namespace, tuple(tokens)))
        if entry is None or not reply or not _same_row(entry.logits, logits):
            return True
        have, new = entry.reply, tuple(reply)
        short, long = (have, new) if len(have) <= len(new) else (new, have)
        if long[: len(short)] != short:
            entry.reply = ()
            return False
        entry.reply = long
        return True

    def drop_block(self, block: Block) -> int:
        """Forget every entry that reads this block; returns how many went."""
        return len(self.take_block(block))

    def take_block(self, block: Block) -> list[tuple[str, Key, Any, tuple[int, ...]]]:
        """Forget every entry that reads this block; returns them as (namespace, tokens,
        logits, reply), for a disk tier to keep until their blocks come back."""
        keys = self._by_block.pop(block.block_id, set())
        gone = [(key[0], tuple(key[1]), self._entries[key].logits, self._entries[key].reply)
                for key in keys if key in self._entries]
        for key in keys:
            self._discard(key)
        return gone

    def _discard(self, key: NamespacedKey) -> None:
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
        """Forget every entry, saved ones too."""
        self._entries.clear()
        self._by_block.clear()
        self._saved.clear()
        self._replies.clear()

    # ---- saved entries (their blocks out of the pool) --------------------------------------

    def save(self, tokens: Sequence[int], namespace: str, loader: Callable[[], Any],
             reply: Sequence[int] = (), row: str = "") -> None:
        """An entry an earlier process saved: `loader` reads its logits on first hit; `reply`
        the greedy reply saved with them, decoded from the row whose digest is `row`."""
        key = (namespace, tuple(tokens))
        self._saved[key] = loader
        self._keep_reply(key, reply, row)

    def _keep_reply(self, key: NamespacedKey, reply: Sequence[int], row: str = "") -> None:
        if reply:
            self._replies[key] = (tuple(reply), row)
        else:
            self._replies.pop(key, None)

    def park(self, gone: Sequence[tuple[str, Key, Any, tuple[int, ...]]]) -> None:
        """Entries whose block just spilled (`take_block`) wait with their logits in memory,
        so the prompt is still an exact hit once its path loads back; at most `max_entries`
        of them, the oldest dropped first."""
        for namespace, tokens, logits, reply in gone:
            if logits is not None:
                self._saved.pop((namespace, tokens), None)
                self._saved[(namespace, tokens)] = HeldLogits(logits)
                self._keep_reply((namespace, tokens), reply)
        held = [k for k, loader in self._saved.items() if isinstance(loader, HeldLogits)]
        for key in held[: max(len(held) - self.max_entries, 0)]:
            del self._saved[key]
            self._replies.pop(key, None)

    def is_saved(self, tokens: Sequence[int], namespace: str = "") -> bool:
        return (namespace, tuple(tokens)) in self._saved

    def take_saved(self, tokens: Sequence[int], namespace: str = "") -> Callable[[], Any] | None:
        """The saved entry's loader, no longer saved (None if there is none)."""
        self._replies.pop((namespace, tuple(tokens)), None)
        return self._saved.pop((namespace, tuple(tokens)), None)

    def saved_reply(self, tokens: Sequence[int], namespace: str = "") -> tuple[tuple[int, ...],
                                                                           str]:
        """The greedy reply saved with a saved entry's logits (() when none) and the digest of
        the row it began from (a parked entry's computed from its row in memory)."""
        key = (namespace, tuple(tokens))
        reply, row = self._replies.get(key, ((), ""))
        loader = self._saved.get(key)
        if reply and not row and isinstance(loader, HeldLogits):
            row = row_digest(loader.row)
            self._replies[key] = (reply, row)
        return reply, row

    def revive(self, tokens: Sequence[int], namespace: str, tree: RadixTree,
               load: Callable[[PrefixMatch], PrefixMatch]) -> tuple[ExactEntry | None, int]:
        """A saved entry made live again on its first hit: its path in `tree` loaded back from
        disk (`load`), its logits read. Returns the entry (None when its blocks or logits
        cannot all be had: the prompt is then a radix hit at most) and the tokens loaded from
        disk."""
        reply, digest = self._replies.get((namespace, tuple(tokens)), ((), ""))
        loader = self.take_saved(tokens, namespace)
        row = loader() if loader is not None else None
        if row is None:  # read first: a failed read leaves the path to the radix lookup
            return None, 0
        # a parked entry's row is the one its reply came with; a saved one's must have the
        # bits the reply began from, or the prompt decodes rather than replays
        if reply and not isinstance(loader, HeldLogits) and row_digest(row) != digest:
            reply = ()
        match = tree.find_prefix(tokens, namespace)
        resident = match.resident(bs := tree.block_size)
        match = load(match)
        if match.matched < len(tokens):
            return None, max(len(match.blocks) * bs - resident, 0)
        self.put(tokens, match.blocks[: -(-len(tokens) // bs)], row, namespace)
        entry = self.get(tokens, namespace)
        if entry is not None:
            entry.reply = reply  # decoded from this very row
            entry.digest = digest if reply else ""  # checked above: a save need not hash it
        return entry, len(tokens) - resident

    def saved(self) -> list[tuple[str, Key]]:
        """(namespace, tokens) of the saved entries, oldest first."""
        return list(self._saved)

    def held_rows(self) -> dict[tuple[str, Key], Any]:
        """The parked entries' logits rows, for a save to write beside the index."""
        return {k: loader.row for k, loader in self._saved.items()
                if isinstance(loader, HeldLogits)}

    def logits_rows(self) -> dict[tuple[str, Key], Any]:
        """Logits rows of the live entries and of those parked while their blocks are on disk,
        by (namespace, tokens): what a save writes beside the index."""
        rows = self.held_rows()
        rows.update({(e.namespace, tuple(t)): e.logits for t, e in self.items()
                     if e.logits is not None})
        return rows

    def items(self) -> Iterator[tuple[Key, ExactEntry]]:
        """(tokens, entry) per entry, oldest first; the entry names its namespace."""
        return ((tokens, entry) for (_, tokens), entry in self._entries.items())

    def check(self, block_size: int) -> None:
        for (namespace, tokens), entry in self._entries.items():
            key = (namespace, tokens)
            assert entry.namespace == namespace, "exact entry filed under another namespace"
            assert len(entry.blocks) == -(-len(tokens) // block_size), "exact entry block count"
            joined = [t for b in entry.blocks for t in b.token_ids][: len(tokens)]
            assert tuple(joined) == tokens, "exact entry blocks no longer hold its tokens"
            for block in entry.blocks:
                assert key in self._by_block.get(block.block_id, ()), "reverse map out of date"
        for bid, keys in self._by_block.items():
            for key in keys:
                # assert, not index: a stale key must fail as an integrity error, not a KeyError
                found = self._entries.get(key)
                assert found is not None, "reverse map names a dropped entry"
                assert any(b.block_id == bid for b in found.blocks), "stale reverse map"
