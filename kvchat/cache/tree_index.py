"""The tiered cache's state as plain data: an index of the tree, its K/V in the disk tier.

`export_index` first makes the disk tier hold every block of the tree (`disk_tier.persist`),
then returns JSON-ready meta: the tree with each node's tokens and block keys, counters and the
policy's state; no K/V, which lives in the BlockStore. `import_index` rebuilds that tree in an
empty cache with every block on disk: no pool allocation and no block file read, so start-up
time does not grow with the cache; blocks load on their first hit. Exact entries are not kept:
their blocks are on disk after a restart, and the radix tree serves those prompts.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvchat.cache import disk_tier
from kvchat.cache.explain import Tombstones
from kvchat.cache.pins import PinError, saved_pins
from kvchat.cache.radix import Node, RadixTree
from kvchat.cache.stats import Counters

if TYPE_CHECKING:
    from kvchat.cache.kvcache import PagedKVCache

class SnapshotMismatch(ValueError):
    """Saved cache state does not fit this cache (shape, size, version or keys)."""


INDEX_VERSION = 2  # version 1 (`snapshot`) held the K/V of every used block in one file



def tree_records(tree: RadixTree, pinned: frozenset[int] = frozenset()
                 ) -> list[dict[str, Any]]:
    """The roots' children as nested records {"start", "tokens", "keys", "owners",
    "children"}; the roots' children also name their "namespace", and nodes holding a block
    in `pinned` say "pinned": true."""
    top: list[dict[str, Any]] = []
    tops = [c for root in tree.roots.values() for c in root.child_list()]
    stack = [(c, top) for c in reversed(tops)]
    while stack:  # no recursion: a long chain of branch points must not hit the limit
        node, siblings = stack.pop()
        rec: dict[str, Any] = {"start": node.start, "tokens": list(node.tokens),
                               "keys": list(node.keys), "owners": sorted(node.owners),
                               "children": []}
        if node.parent is not None and node.parent.is_root:
            rec["namespace"] = node.namespace
        if any(b.block_id in pinned for b in node.blocks):
            rec["pinned"] = True
        siblings.append(rec)
        stack.extend((c, rec["children"]) for c in reversed(node.child_list()))
    return top


def tree_from_records(tree: RadixTree, records: Sequence[Mapping[str, Any]]) -> RadixTree:
    """Fill the empty `tree` with the records' nodes, every block on disk. Keys are recomputed
    from the tokens: records made under another fingerprint or namespace do not match. Raises
    ValueError when the records do not describe a valid tree."""
    try:
        stack: list[tuple[Mapping[str, Any], Node | None, str]] = [
            (rec, None, str(rec.get("namespace", ""))) for rec in reversed(records)]
        while stack:
            rec, parent, namespace = stack.pop()
            node = tree.graft(parent, namespace, [int(t) for t in rec["tokens"]])
            if int(rec["start"]) != node.start:
                raise AssertionError("a node does not start where its parent ends")
            if [str(k) for k in rec["keys"]] != node.keys:
                raise AssertionError("block keys do not match this model or namespace")
            node.owners = {str(o) for o in rec.get("owners", [])}
            stack.extend((c, node, namespace) for c in reversed(list(rec["children"])))
        tree.check()
    except (KeyError, IndexError, TypeError, AssertionError) as exc:
        raise ValueError(f"not a radix tree ({type(exc).__name__}: {exc})") from exc
    return tree


def export_index(cache: PagedKVCache) -> dict[str, Any]:
    """Persist the blocks (when the cache has a disk tier) and return the index's meta."""
    mgr = cache.manager
    if cache.disk is not None and cache.disk.enabled:
        disk_tier.persist(cache.disk, mgr, cache.tree, lambda node, first:
                          cache.tombstones.record_subtree(cache.tree, node, first, "disk budget"))
    return {
        "version": INDEX_VERSION,
        "block_size": cache.block_size,
        "shape": [mgr.n_layers, mgr.n_kv_heads, mgr.head_dim],
        "policy": cache.policy.name,
        "policy_state": cache.policy.state(),
        "tree": tree_records(cache.tree, cache.pins.block_ids),
        "pins": cache.pins.to_json(),
        "tombstones": cache.tombstones.to_json(),
        "counters": cache.stats().counters_json(),
        "resident_blocks": mgr.num_blocks - mgr.num_free,  # `kvchat inspect`'s memory tier
        "disk_tokens": cache.stats().disk_tokens,
        "exact": exact_records(cache),
    }


def exact_records(cache: PagedKVCache) -> list[dict[str, Any]]:
    """The exact entries to save, oldest first, at most the index's capacity: the live ones,
    and those an earlier process saved that no prompt has hit since (their logits file stays
    as it is) while the tree still holds their tokens, so a file run again gets exact hits."""
    bs, tree = cache.block_size, cache.tree
    live = [(e.namespace, tokens, len(e.blocks)) for tokens, e in cache.exact.items()
            if e.logits is not None]
    saved = [(namespace, tokens, -(-len(tokens) // bs)) for namespace, tokens in cache.saved_exact
             if not cache.exact.has(tokens, namespace)
             and tree.find_prefix(tokens, namespace).matched == len(tokens)]
    kept = (saved + live)[-cache.exact.max_entries:] if cache.exact.max_entries else []
    return [{"tokens": list(tokens), "namespace": namespace, "blocks": n_blocks,
             "logits": exact_name(tree, namespace, tokens)} for namespace, tokens, n_blocks in kept]


def exact_name(tree: RadixTree, namespace: str, tokens: Sequence[int]) -> str:
    """The file name (without extension) of an exact entry's saved logits: it hashes the
    chain's root key (model fingerprint and namespace) and the prompt, as block keys do."""
    data = tree.root_key(namespace).encode() + b"\0" + ",".join(map(str, tokens)).encode()
    return hashlib.sha256(data).hexdigest()[:40]


def exact_logits(cache: PagedKVCache) -> dict[str, Any]:
    """The exact entries' logits rows by file name (`exact_name`), those parked while their
    blocks are on disk too: what a save writes beside the index, once per entry."""
    rows = {exact_name(cache.tree, ns, t): row
            for (ns, t), row in disk_tier.held_logits(cache).items()}
    return rows | {exact_name(cache.tree, e.namespace, t): e.logits
                   for t, e in cache.exact.items() if e.logits is not None}


def import_index(cache: PagedKVCache, meta: Mapping[str, Any],
                 logits: Callable[[str], Any] = lambda name: None) -> None:
    """Rebuild the saved tree in an empty cache, every block on disk; exact entries wait in
    `cache.saved_exact` until first hit, when `logits(name)` reads theirs. Raises
    SnapshotMismatch if the index does not fit or hold together, leaving the cache empty."""
    try:
        if meta.get("version") != INDEX_VERSION:
            raise SnapshotMismatch(f"index version {meta.get('version')} is not "
                                   f"{INDEX_VERSION}")
        mgr = cache.manager
        if meta["block_size"] != cache.block_size:
            raise SnapshotMismatch("block size differs")
        if list(meta["shape"]) != [mgr.n_layers, mgr.n_kv_heads, mgr.head_dim]:
            raise SnapshotMismatch("K/V shape differs")
        if mgr.num_free != mgr.num_blocks:
            raise SnapshotMismatch("the cache is not empty")
        tree = tree_from_records(cache.new_tree(), meta["tree"])
        cache.restore(tree, Counters.counters_from_json(meta["counters"]))
        cache.policy.restore(meta.get("policy_state") or {})
        cache.tombstones = Tombstones.from_json(meta.get("tombstones", []),
                                                cache.tombstones.capacity)
        for rec in meta.get("exact", []):
            key = (str(rec.get("namespace", "")), tuple(int(t) for t in rec["tokens"]))
            cache.saved_exact[key] = functools.partial(logits, str(rec["logits"]))
        cache.check_integrity()
        _repin(cache, saved_pins(meta.get("pins", [])))
    except SnapshotMismatch:
        cache.reset()
        raise
    except (KeyError, IndexError, TypeError, ValueError, AssertionError) as exc:
        cache.reset()
        raise SnapshotMismatch(f"the index is damaged ({type(exc).__name__}: {exc})") from exc


def _repin(cache: PagedKVCache, pins: Sequence[tuple[str, tuple[int, ...], str]]) -> None:
    """Pin again what was pinned at the save: its blocks load from disk now, since pinned
    blocks live in the pool. A pin that no longer fits (a smaller pool, a block lost from
    disk) is dropped with a notice."""
    for namespace, tokens, label in pins:
        try:
            cache.pin(tokens, namespace, label)
        except PinError as exc:
            cache.notice(f"A saved pin ({label}, {len(tokens)} tokens) was dropped: {exc}")
