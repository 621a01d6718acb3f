"""The cache's documents: plain-data views of the shared cache, built from a live PagedKVCache or
from a snapshot's index.json, so that `kvchat chat`, `kvchat inspect` and the server describe it
with one schema: the tree as NodeViews, the exact index as ExactViews, the numbers as
`CacheStats`, and the JSON document of `kvchat inspect --json` and the server's `/cache/tree`
from `inspect_document` (the server's JSON schema; docs/inspect.md has it).

Nothing here imports torch or Rich: `kvchat inspect` reads a snapshot with this module alone.
The snapshot's tree records are parsed by `kvchat.cache.tree_index.read_tree`; adapters from a
snapshot raise SnapshotFormatError (a ValueError) when index.json does not have its shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from kvchat.cache.state import TreeRecord, build_bottom_up
from kvchat.cache.stats import CacheStats, Counters, PoolStats
from kvchat.cache.tree_index import SnapshotFormatError, read_tree
from kvchat.inspect.previews import Decode, distinct_offsets, distinct_preview

if TYPE_CHECKING:
    from kvchat.cache.kvcache import PagedKVCache

__all__ = ["Decode", "ExactView", "NodeView", "SnapshotFormatError", "covers", "exact_from_cache",
           "exact_from_meta", "exact_json", "for_session", "in_namespace", "inspect_document",
           "nodes_from_cache", "nodes_from_meta", "owned_by", "stats_from_meta", "tiers_json",
           "tree_json", "walk"]


@dataclass(frozen=True)
class NodeView:
    """One radix-tree node: its edge tokens, how many pool blocks hold them (and how many of
    its blocks are only in the disk tier), the highest reference count among the pool blocks
    (requests reading them now), the sessions whose sequences pass through it, and the cache
    namespace it belongs to (its children share it)."""

    start: int
    tokens: tuple[int, ...]
    blocks: int
    max_ref: int
    owners: tuple[str, ...]
    children: tuple[NodeView, ...] = ()
    namespace: str = ""
    pinned: bool = False  # holds blocks of a pinned prefix: eviction never takes them
    disk_blocks: int = 0  # blocks of the edge only on disk (loaded back when a prompt hits)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def descendants(self) -> int:
        """Nodes below this one."""
        count, stack = 0, list(self.children)
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children)
        return count


@dataclass(frozen=True)
class ExactView:
    """One exact-index entry: a whole prompt, its blocks, and whether its logits are kept
    (then a repeat of that prompt needs no forward pass)."""

    tokens: tuple[int, ...]
    blocks: int
    has_logits: bool
    namespace: str = ""
    # a server's document gives no token ids for an entry: its length and preview instead
    length: int | None = None
    preview: str | None = None

    @property
    def n_tokens(self) -> int:
        return self.length if self.length is not None else len(self.tokens)


# ---- building the views --------------------------------------------------------------------

T = TypeVar("T")


def _freeze(roots: Sequence[T], children: Callable[[T], Sequence[T]],
            view: Callable[[T, tuple[NodeView, ...]], NodeView]) -> tuple[NodeView, ...]:
    """Build NodeViews bottom-up without recursion (`build_bottom_up`)."""
    return build_bottom_up(roots, children, view)


def nodes_from_cache(cache: PagedKVCache) -> tuple[NodeView, ...]:
    """The live radix tree (children in insertion order)."""

    def view(node: Any, kids: tuple[NodeView, ...]) -> NodeView:
        return NodeView(
            start=node.start,
            tokens=tuple(node.tokens),
            blocks=len(node.blocks),
            max_ref=max((b.ref_count for b in node.blocks), default=0),
            owners=tuple(sorted(node.owners)),
            children=kids,
            namespace=node.namespace,
            pinned=any(cache.pins.holds(b.block_id) for b in node.blocks),
            disk_blocks=node.on_disk,
        )

    tops = [c for root in cache.tree.roots.values() for c in root.child_list()]
    return _freeze(tops, lambda n: n.child_list(), view)


def exact_from_cache(cache: PagedKVCache) -> tuple[ExactView, ...]:
    return tuple(
        ExactView(tuple(key), len(entry.blocks), entry.logits is not None, entry.namespace)
        for key, entry in cache.exact.items()
    )


def _damaged(exc: Exception) -> SnapshotFormatError:
    return SnapshotFormatError(
        f"index.json does not describe a cache ({type(exc).__name__}: {exc})"
    )


def nodes_from_meta(meta: Mapping[str, Any]) -> tuple[NodeView, ...]:
    """The radix tree as a snapshot recorded it (`read_tree`). A snapshot holds no requests,
    so every reference count is 0."""

    def view(rec: TreeRecord, kids: tuple[NodeView, ...]) -> NodeView:
        return NodeView(rec.start, rec.tokens, rec.blocks, 0, rec.owners, kids, rec.namespace,
                        rec.pinned)

    roots = read_tree(meta)
    return _freeze(roots, lambda r: r.children, view)


def exact_from_meta(meta: Mapping[str, Any]) -> tuple[ExactView, ...]:
    try:
        return tuple(
            ExactView(tuple(map(int, e["tokens"])),
                      e["blocks"] if isinstance(e["blocks"], int) else len(e["blocks"]),
                      bool(e.get("logits")),
                      str(e.get("namespace", "")))
            for e in meta.get("exact", [])
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise _damaged(exc) from exc


def stats_from_meta(meta: Mapping[str, Any], nodes: Sequence[NodeView]) -> CacheStats:
    """The statistics a snapshot recorded, with its tree's size taken from `nodes`."""
    try:
        pool = dict(meta.get("pool") or {})
        return CacheStats.build(
            Counters.counters_from_json(dict(meta.get("counters", {}))),
            policy=str(meta.get("policy", "?")),
            pool=PoolStats.from_json(
                pool | {"block_size": meta["block_size"],
                        "used_blocks": meta.get("resident_blocks", len(meta.get("blocks", [])))}
            ),
            tree_nodes=sum(1 for _ in walk(nodes)),
            tree_tokens=sum(n.n_tokens for n in walk(nodes)),
            exact_entries=len(meta.get("exact", [])),
            disk_tokens=int(meta.get("disk_tokens", 0)),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _damaged(exc) from exc


# ---- queries -------------------------------------------------------------------------------


def walk(nodes: Iterable[NodeView]) -> Iterable[NodeView]:
    """Every node, depth first."""
    stack = list(reversed(list(nodes)))
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.children))


def owned_by(nodes: Sequence[NodeView], session: str) -> tuple[NodeView, ...]:
    """The branches a session's sequences pass through (owners are recorded on every node of
    such a path, so the result stays connected to the root)."""
    return _freeze(
        [n for n in nodes if session in n.owners],
        lambda n: [c for c in n.children if session in c.owners],
        lambda n, kids: replace(n, children=kids),
    )


def in_namespace(
    nodes: Sequence[NodeView],
    exact: Sequence[ExactView],
    namespace: str,
    owner: Callable[[str], str | None] = lambda name: name,
) -> tuple[tuple[NodeView, ...], tuple[ExactView, ...]]:
    """One namespace's branches and exact entries, nothing of any other. `owner` renames each
    session name on them, or hides it (None): a tenant sees its own sessions, by their own
    names."""

    def keep(n: NodeView, kids: tuple[NodeView, ...]) -> NodeView:
        owners = tuple(sorted(o for o in map(owner, n.owners) if o is not None))
        return replace(n, owners=owners, children=kids)

    mine = _freeze([n for n in nodes if n.namespace == namespace], lambda n: n.children, keep)
    return mine, tuple(e for e in exact if e.namespace == namespace)


def for_session(
    nodes: Sequence[NodeView], exact: Sequence[ExactView], session: str | None
) -> tuple[tuple[NodeView, ...], tuple[ExactView, ...]]:
    """The branches a session went through and the exact entries on them (all, for None)."""
    if session is None:
        return tuple(nodes), tuple(exact)
    mine = owned_by(nodes, session)
    return mine, tuple(e for e in exact if covers(mine, e.tokens))


def covers(nodes: Sequence[NodeView], tokens: Sequence[int]) -> bool:
    """True if `tokens` is a path from the root through these nodes (ending anywhere in an
    edge)."""
    level, pos = nodes, 0
    while pos < len(tokens):
        rest = tuple(tokens[pos:])
        # either the edge is a prefix of what is left, or what is left ends inside the edge
        node = next((c for c in level if c.tokens[: len(rest)] == rest[: c.n_tokens]), None)
        if node is None:
            return False
        pos += node.n_tokens
        level = node.children
    return True


# ---- JSON ----------------------------------------------------------------------------------


def tree_json(
    nodes: Sequence[NodeView], decode: Decode | None = None, depth: int | None = None
) -> list[dict[str, Any]]:
    """The tree as nested JSON objects; below `depth` levels children are left out and counted
    in `children_omitted`."""

    def group(siblings: Sequence[NodeView], level: int) -> list[dict[str, Any]]:
        shared = distinct_offsets([n.tokens for n in siblings])
        return [one(n, s, level) for n, s in zip(siblings, shared, strict=True)]

    def one(node: NodeView, shared: int, level: int) -> dict[str, Any]:
        keep = depth is None or level < depth
        return {
            "start": node.start,
            "n_tokens": node.n_tokens,
            "n_blocks": node.blocks,
            "disk_blocks": node.disk_blocks,
            "max_ref": node.max_ref,
            "owners": list(node.owners),
            "pinned": node.pinned,
            "preview": distinct_preview(node.tokens, shared, decode),
            "tokens": list(node.tokens),
            "children": group(node.children, level + 1) if keep else [],
            "children_omitted": 0 if keep else len(node.children),
        }

    return group(nodes, 1)


def exact_json(entries: Sequence[ExactView], decode: Decode | None = None) -> list[dict[str, Any]]:
    shared = distinct_offsets([e.tokens for e in entries])
    return [
        {"n_tokens": e.n_tokens, "n_blocks": e.blocks, "has_logits": e.has_logits,
         "distinct_from": s, "preview": distinct_preview(e.tokens, s, decode)}
        for e, s in zip(entries, shared, strict=True)
    ]


def inspect_document(
    fingerprint: Mapping[str, Any],
    snapshot_info: Mapping[str, Any],
    stats: CacheStats,
    nodes: Sequence[NodeView],
    exact: Sequence[ExactView],
    decode: Decode | None = None,
    depth: int | None = None,
    session: str | None = None,
    disk: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON document of `kvchat inspect --json` and the server's `/cache/tree` (schema in
    docs/inspect.md). `snapshot_info` holds "path", "saved_at", "model_label" and "tokenizer_file";
    with `session`, the tree and exact entries are that session's (`for_session`), while
    "stats" and "pool" stay the whole cache's."""
    nodes, exact = for_session(nodes, exact, session)
    stats_doc = stats.to_json()
    return {
        "fingerprint": dict(fingerprint),
        "snapshot": {**snapshot_info, "session": session},
        "stats": stats_doc,
        "pool": stats_doc["pool"],
        "tree": tree_json(nodes, decode, depth),
        "exact": exact_json(exact, decode),
        "tiers": tiers_json(stats, disk),
    }


def tiers_json(stats: CacheStats, disk: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Both tiers: the pool's blocks and the tokens in it; the disk tier's files ("blocks",
    "bytes", "budget_bytes", "path": None when not read) and the tokens only there."""
    memory = {"blocks": stats.pool.used_blocks, "total_blocks": stats.pool.total_blocks,
              "tokens": stats.tree_tokens - stats.disk_tokens}
    files = dict(disk or {"blocks": None, "bytes": None, "budget_bytes": None, "path": None})
    return {"memory": memory, "disk": {**files, "tokens": stats.disk_tokens}}
