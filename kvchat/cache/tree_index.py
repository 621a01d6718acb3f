"""The snapshot's tree index: `cache/index.json` of a sessions dir, the one owner of its schema.

A CacheState (`kvchat.cache.state`) as JSON, written by `export_index` and read back by
`read_state` / `import_index`; `kvchat inspect`, the server and `kvchat.snapshots` read its tree
with `read_tree`, so the records are parsed in one place. No K/V: those live in the disk tier
(whose own `index.json`, the block index, is `kvchat.cache.block_index`'s). Torch-free.

    {"version": 2, "block_size": N, "shape": [layers, kv heads, head dim],
     "policy": name, "policy_state": {...}, "counters": {...},
     "tree": [record, ...], "pins": [{"id", "namespace", "tokens", "label"}, ...],
     "tombstones": [[key, key before, tokens, when, policy], ...],
     "exact": [{"tokens", "namespace", "blocks", "logits", "reply", "row"}, ...],
     "resident_blocks": N, "disk_tokens": N, ... what the snapshot adds (fingerprint, ...)}
    record: {"start", "tokens", "keys", "owners", "children": [record, ...]}, plus
            "namespace" on the roots' children and "pinned": true on nodes holding a pin's block

A version 1 index (`blocks`: the K/V of every used block in one file, records naming them by
id) is still read by `read_tree`, for `kvchat inspect`; a cache never loads one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvchat.cache.pins import pin_id
from kvchat.cache.radix import RadixTree
from kvchat.cache.state import (
    CacheState,
    SavedExact,
    SavedPin,
    SnapshotMismatch,
    TreeRecord,
    build_bottom_up,
    exact_name,
    graft,
    records_of,
)
from kvchat.cache.stats import Counters
from kvchat.cache.tombstones import Tombstone

if TYPE_CHECKING:
    from kvchat.cache.kvcache import PagedKVCache

__all__ = ["TREE_INDEX", "TREE_INDEX_VERSION", "SnapshotFormatError", "SnapshotMismatch",
           "exact_logits", "export_index", "import_index", "read_state", "read_tree",
           "state_document", "tree_from_records", "tree_records", "walk_records"]

TREE_INDEX = "index.json"  # in a sessions dir's cache/ folder
TREE_INDEX_VERSION = 2  # version 1 (`snapshot`) held the K/V of every used block in one file


class SnapshotFormatError(ValueError):
    """index.json parsed as JSON but does not describe a cache."""


def _damaged(exc: Exception) -> SnapshotFormatError:
    return SnapshotFormatError(
        f"index.json does not describe a cache ({type(exc).__name__}: {exc})")


# ---- reading -------------------------------------------------------------------------------


def parse_records(records: Sequence[Mapping[str, Any]],
                  v1_blocks: Sequence[Sequence[int]] | None = None) -> tuple[TreeRecord, ...]:
    """Tree records as TreeRecords; only the top ones name their namespace, their descendants
    share it. `v1_blocks` (the tokens of a version 1 index's blocks) resolves records that
    name blocks by id. Raises KeyError, TypeError, ... on a record of another shape."""
    namespace_of: dict[int, str] = {}
    stack = [(rec, str(rec.get("namespace", ""))) for rec in records]
    while stack:
        rec, namespace = stack.pop()
        namespace_of[id(rec)] = namespace
        stack.extend((child, namespace) for child in rec["children"])

    def make(rec: Mapping[str, Any], kids: tuple[TreeRecord, ...]) -> TreeRecord:
        if "tokens" in rec or v1_blocks is None:
            tokens, keys = tuple(int(t) for t in rec["tokens"]), tuple(str(k) for k in rec["keys"])
            n_blocks = len(keys)
        else:
            ids = [int(i) for i in rec["blocks"]]
            tokens, keys, n_blocks = tuple(t for i in ids for t in v1_blocks[i]), (), len(ids)
        return TreeRecord(int(rec["start"]), tokens, keys, n_blocks,
                          tuple(sorted(str(o) for o in rec.get("owners", []))),
                          namespace_of[id(rec)], bool(rec.get("pinned", False)), kids)

    return build_bottom_up(list(records), lambda r: list(r["children"]), make)


def read_tree(meta: Mapping[str, Any]) -> tuple[TreeRecord, ...]:
    """The saved radix tree of an index (version 2, or 1). Raises SnapshotFormatError (a
    ValueError) when it does not have the shape `export_index` writes."""
    try:
        v1 = [[int(t) for t in b["tokens"]] for b in meta["blocks"]] if "blocks" in meta else None
        return parse_records(meta["tree"], v1)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise _damaged(exc) from exc


def walk_records(records: Iterable[TreeRecord]) -> Iterator[TreeRecord]:
    """Every record, depth first."""
    stack = list(reversed(list(records)))
    while stack:
        rec = stack.pop()
        yield rec
        stack.extend(reversed(rec.children))


def read_state(meta: Mapping[str, Any]) -> CacheState:
    """The CacheState an index holds. Raises SnapshotMismatch for another version, and
    SnapshotFormatError (a ValueError) when it is damaged."""
    if meta.get("version") != TREE_INDEX_VERSION:
        raise SnapshotMismatch(f"index version {meta.get('version')} is not "
                               f"{TREE_INDEX_VERSION}")
    tree = read_tree(meta)
    try:
        n_layers, n_kv_heads, head_dim = (int(x) for x in meta["shape"])
        tombstones: list[Tombstone] = [
            (str(key), str(prev), tuple(int(t) for t in tokens), float(when), str(policy))
            for key, prev, tokens, when, policy in meta.get("tombstones", [])]
        return CacheState(
            block_size=int(meta["block_size"]),
            shape=(n_layers, n_kv_heads, head_dim),
            policy=str(meta.get("policy", "")),
            policy_state=dict(meta.get("policy_state") or {}),
            tree=tree,
            counters=Counters.counters_from_json(meta["counters"]),
            pins=tuple(SavedPin(str(r.get("namespace", "")), tuple(int(t) for t in r["tokens"]),
                                str(r.get("label", "prefix")))
                       for r in meta.get("pins", [])),
            tombstones=tuple(tombstones),
            exact=tuple(SavedExact(str(r.get("namespace", "")),
                                   tuple(int(t) for t in r["tokens"]),
                                   int(r.get("blocks", 0)), str(r["logits"]),
                                   tuple(int(t) for t in r.get("reply", ())),
                                   str(r.get("row", "")))
                        for r in meta.get("exact", [])),
            resident_blocks=int(meta.get("resident_blocks", 0)),
            disk_tokens=int(meta.get("disk_tokens", 0)),
        )
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise _damaged(exc) from exc


def tree_from_records(tree: RadixTree, records: Sequence[Mapping[str, Any]]) -> RadixTree:
    """Fill the empty `tree` with the JSON records' nodes, every block on disk (`state.graft`).
    Raises ValueError when the records do not describe a valid tree."""
    try:
        parsed = parse_records(records)
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a radix tree ({type(exc).__name__}: {exc})") from exc
    return graft(tree, parsed)


# ---- writing -------------------------------------------------------------------------------


def records_json(records: Sequence[TreeRecord]) -> list[dict[str, Any]]:
    """TreeRecords as the index's nested JSON records (see the module docstring)."""
    top: list[dict[str, Any]] = []
    stack: list[tuple[TreeRecord, list[dict[str, Any]], bool]] = [
        (r, top, True) for r in reversed(records)]
    while stack:  # no recursion: a long chain of branch points must not hit the limit
        rec, siblings, is_top = stack.pop()
        out: dict[str, Any] = {"start": rec.start, "tokens": list(rec.tokens),
                               "keys": list(rec.keys), "owners": list(rec.owners),
                               "children": []}
        if is_top:
            out["namespace"] = rec.namespace
        if rec.pinned:
            out["pinned"] = True
        siblings.append(out)
        stack.extend((c, out["children"], False) for c in reversed(rec.children))
    return top


def tree_records(tree: RadixTree, pinned: frozenset[int] = frozenset()
                 ) -> list[dict[str, Any]]:
    """A live tree's nodes as the index's JSON records (nodes holding a block in `pinned`
    say "pinned": true)."""
    return records_json(records_of(tree, pinned))


def state_document(state: CacheState) -> dict[str, Any]:
    """A CacheState as the index's JSON document (the snapshot adds its own keys to it)."""
    return {
        "version": TREE_INDEX_VERSION,
        "block_size": state.block_size,
        "shape": list(state.shape),
        "policy": state.policy,
        "policy_state": dict(state.policy_state),
        "tree": records_json(state.tree),
        "pins": [{"id": pin_id(p.namespace, p.tokens), "namespace": p.namespace,
                  "tokens": list(p.tokens), "label": p.label} for p in state.pins],
        "tombstones": [[k, prev, list(t), w, p] for k, prev, t, w, p in state.tombstones],
        "counters": state.counters.counters_json(),
        "resident_blocks": state.resident_blocks,
        "disk_tokens": state.disk_tokens,
        "exact": [{"tokens": list(e.tokens), "namespace": e.namespace, "blocks": e.blocks,
                   "logits": e.logits, "reply": list(e.reply), "row": e.row}
                  for e in state.exact],
    }


# ---- a live cache --------------------------------------------------------------------------


def export_index(cache: PagedKVCache) -> dict[str, Any]:
    """Persist the blocks (when the cache has a disk tier) and return the index's meta."""
    cache.persist()
    return state_document(cache.export())


def exact_logits(cache: PagedKVCache) -> dict[str, Any]:
    """The exact entries' logits rows by file name (`exact_name`), those parked while their
    blocks are on disk too: what a save writes beside the index, once per entry."""
    rows = cache.exact.logits_rows()
    return {exact_name(cache.tree, ns, t): row for (ns, t), row in rows.items()}


def import_index(cache: PagedKVCache, meta: Mapping[str, Any],
                 logits: Callable[[str], Any] = lambda name: None) -> None:
    """Rebuild the saved tree in an empty cache, every block on disk (`PagedKVCache.restore`);
    exact entries wait until first hit, when `logits(name)` reads theirs. Raises
    SnapshotMismatch if the index does not fit or hold together, leaving the cache empty."""
    try:
        state = read_state(meta)
    except SnapshotMismatch:
        cache.reset()
        raise
    except SnapshotFormatError as exc:
        cache.reset()
        raise SnapshotMismatch(f"the index is damaged ({exc})") from exc
    cache.restore(state, logits)
