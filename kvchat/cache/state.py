"""CacheState: what a PagedKVCache keeps across processes, as plain typed data.

`PagedKVCache.export()` returns one and `restore()` adopts one; the snapshot (`tree_index`)
turns it into `index.json` and back. It holds no K/V: those live in the disk tier, keyed by
the chained block keys the tree records carry, so a restored tree has every block on disk and
loads each on its first hit. Torch-free: `kvchat inspect` reads the records without a model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvchat.cache.radix import RadixTree
from kvchat.cache.radix_node import Node
from kvchat.cache.stats import Counters
from kvchat.cache.tombstones import Tombstone

if TYPE_CHECKING:
    from kvchat.cache.exact import ExactIndex


class SnapshotMismatch(ValueError):
    """Saved cache state does not fit this cache (shape, size, version or keys)."""


@dataclass(frozen=True)
class TreeRecord:
    """One radix-tree node as saved: its edge, one block key per block (none in a version 1
    index, which named pool blocks instead), the sessions through it, its namespace (children
    share it) and whether it held a pinned block."""

    start: int
    tokens: tuple[int, ...]
    keys: tuple[str, ...]
    blocks: int  # blocks of the edge
    owners: tuple[str, ...] = ()  # sorted
    namespace: str = ""
    pinned: bool = False
    children: tuple[TreeRecord, ...] = ()


@dataclass(frozen=True)
class SavedExact:
    """An exact-index entry as saved: its prompt, how many blocks cover it, and the name of
    its logits file (`exact_name`)."""

    namespace: str
    tokens: tuple[int, ...]
    blocks: int
    logits: str
    reply: tuple[int, ...] = ()  # the greedy reply decoded from those logits (`ExactEntry`)
    row: str = ""  # with a reply: the digest of the logits row it began from (`row_digest`)


@dataclass(frozen=True)
class SavedPin:
    """A pin as saved: its prefix; block ids are the pool's and do not survive a restart."""

    namespace: str
    tokens: tuple[int, ...]
    label: str = "prefix"


@dataclass(frozen=True)
class CacheState:
    """Every field a snapshot needs to rebuild a cache (see the module docstring)."""

    block_size: int
    shape: tuple[int, int, int]  # (n_layers, n_kv_heads, head_dim): K/V must match to be reused
    policy: str
    policy_state: Mapping[str, Any]
    tree: tuple[TreeRecord, ...]
    counters: Counters
    pins: tuple[SavedPin, ...] = ()
    tombstones: tuple[Tombstone, ...] = ()
    exact: tuple[SavedExact, ...] = ()
    resident_blocks: int = 0  # pool blocks in use at export (`kvchat inspect`'s memory tier)
    disk_tokens: int = 0  # tokens only in the disk tier at export


T = TypeVar("T")
U = TypeVar("U")


def build_bottom_up(roots: Sequence[T], children: Callable[[T], Sequence[T]],
                    make: Callable[[T, tuple[U, ...]], U]) -> tuple[U, ...]:
    """Build an immutable tree bottom-up without recursion (a long chain of branch points must
    not hit Python's recursion limit)."""
    built: dict[int, U] = {}
    stack: list[tuple[T, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        item, expanded = stack.pop()
        if expanded:
            built[id(item)] = make(item, tuple(built.pop(id(c)) for c in children(item)))
        else:
            stack.append((item, True))
            stack.extend((c, False) for c in reversed(children(item)))
    return tuple(built.pop(id(r)) for r in roots)


def records_of(tree: RadixTree, pinned: frozenset[int] = frozenset()) -> tuple[TreeRecord, ...]:
    """The tree's nodes below its roots as records; nodes holding a block in `pinned` (block
    ids) are marked pinned."""

    def make(node: Node, kids: tuple[TreeRecord, ...]) -> TreeRecord:
        return TreeRecord(node.start, tuple(node.tokens), tuple(node.keys), len(node.keys),
                          tuple(sorted(node.owners)), node.namespace,
                          any(b.block_id in pinned for b in node.blocks), kids)

    tops = [c for root in tree.roots.values() for c in root.child_list()]
    return build_bottom_up(tops, lambda n: n.child_list(), make)


def graft(tree: RadixTree, records: Sequence[TreeRecord]) -> RadixTree:
    """Fill the empty `tree` with the records' nodes, every block on disk. Keys are recomputed
    from the tokens: records made under another fingerprint or namespace do not match. Raises
    ValueError when the records do not describe a valid tree."""
    try:
        stack: list[tuple[TreeRecord, Node | None]] = [(r, None) for r in reversed(records)]
        while stack:
            rec, parent = stack.pop()
            node = tree.graft(parent, rec.namespace, list(rec.tokens))
            if rec.start != node.start:
                raise AssertionError("a node does not start where its parent ends")
            if list(rec.keys) != node.keys:
                raise AssertionError("block keys do not match this model or namespace")
            node.owners = set(rec.owners)
            stack.extend((c, node) for c in reversed(rec.children))
        tree.check_integrity()
    except (KeyError, IndexError, TypeError, AssertionError) as exc:
        raise ValueError(f"not a radix tree ({type(exc).__name__}: {exc})") from exc
    return tree


def exact_name(tree: RadixTree, namespace: str, tokens: Sequence[int]) -> str:
    """The file name (without extension) of an exact entry's saved logits: it hashes the
    chain's root key (model fingerprint and namespace) and the prompt, as block keys do."""
    data = tree.root_key(namespace).encode() + b"\0" + ",".join(map(str, tokens)).encode()
    return hashlib.sha256(data).hexdigest()[:40]


def exact_to_save(tree: RadixTree, exact: ExactIndex) -> tuple[SavedExact, ...]:
    """The exact entries a snapshot saves, oldest first, at most the index's capacity: the live
    ones, and those saved earlier that no prompt has hit since (their logits file stays as it
    is) while the tree still holds their tokens, so a file run again gets exact hits."""
    bs = tree.block_size
    live = [(e.namespace, tokens, len(e.blocks), (e.reply, e.row_of() if e.reply else ""))
            for tokens, e in exact.items() if e.logits is not None]
    saved = [(ns, tokens, -(-len(tokens) // bs), exact.saved_reply(tokens, ns))
             for ns, tokens in exact.saved()
             if not exact.has(tokens, ns)
             and tree.find_prefix(tokens, ns).matched == len(tokens)]
    kept = (saved + live)[-exact.max_entries:] if exact.max_entries else []
    return tuple(SavedExact(ns, tuple(tokens), n_blocks, exact_name(tree, ns, tokens), *reply)
                 for ns, tokens, n_blocks, reply in kept)
