"""Plain-data views of the shared cache, built from a live PagedKVCache or from a snapshot's
index.json, so that `kvchat chat`, `kvchat inspect` and the server describe it with one schema:
the tree as NodeViews, the exact index as ExactViews, the numbers as `CacheStats`, and the JSON
document of `kvchat inspect --json` and `/cache/tree` from `inspect_document`.

Nothing here imports torch or Rich: `kvchat inspect` reads a snapshot with this module alone.
Adapters from a snapshot raise SnapshotFormatError (a ValueError) when index.json does not
have the shape `kvchat.cache.tree_index.export_index` writes.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from kvchat.cache.stats import CacheStats, Counters, PoolStats

if TYPE_CHECKING:
    from kvchat.cache.kvcache import PagedKVCache

Decode = Callable[[Sequence[int]], str]
PREVIEW_CHARS = 24
# Decoding more than this many tokens per edge could never add to a 24-character preview.
PREVIEW_TOKENS = 32


class SnapshotFormatError(ValueError):
    """index.json parsed as JSON but does not describe a cache."""


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


# ---- building the views --------------------------------------------------------------------

T = TypeVar("T")


def _freeze(
    roots: Sequence[T],
    children: Callable[[T], Sequence[T]],
    view: Callable[[T, tuple[NodeView, ...]], NodeView],
) -> tuple[NodeView, ...]:
    """Build NodeViews bottom-up without recursion (a long chain of branch points must not hit
    Python's recursion limit)."""
    built: dict[int, NodeView] = {}
    stack: list[tuple[T, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        item, expanded = stack.pop()
        if expanded:
            built[id(item)] = view(item, tuple(built.pop(id(c)) for c in children(item)))
        else:
            stack.append((item, True))
            stack.extend((c, False) for c in reversed(children(item)))
    return tuple(built.pop(id(r)) for r in roots)


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
    """The radix tree as a snapshot recorded it. A snapshot holds no requests, so every
    reference count is 0."""
    try:
        block_tokens = [list(map(int, b["tokens"])) for b in meta.get("blocks", [])]
        # only the top records name their namespace; their descendants share it
        namespace_of: dict[int, str] = {}
        stack = [(rec, str(rec.get("namespace", ""))) for rec in meta["tree"]]
        while stack:
            rec, namespace = stack.pop()
            namespace_of[id(rec)] = namespace
            stack.extend((child, namespace) for child in rec["children"])

        def view(rec: Mapping[str, Any], kids: tuple[NodeView, ...]) -> NodeView:
            if "tokens" in rec:  # version 2: tokens and block keys per node
                tokens, n_blocks = tuple(map(int, rec["tokens"])), len(rec["keys"])
            else:
                ids = [int(i) for i in rec["blocks"]]
                tokens, n_blocks = tuple(t for i in ids for t in block_tokens[i]), len(ids)
            owners = tuple(sorted(str(o) for o in rec.get("owners", [])))
            return NodeView(int(rec["start"]), tokens, n_blocks, 0, owners, kids,
                            namespace_of[id(rec)], bool(rec.get("pinned", False)))

        return _freeze(list(meta["tree"]), lambda r: list(r["children"]), view)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise _damaged(exc) from exc


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


# ---- text previews -------------------------------------------------------------------------


def _clean(text: str) -> str:
    """Newlines become ⏎, other control characters ·: one line, nothing a terminal executes."""
    out = []
    for ch in text.replace("\r\n", "\n"):
        if ch in "\n\r":
            out.append("⏎")
        elif unicodedata.category(ch) == "Cc":
            out.append("·")
        else:
            out.append(ch)
    return "".join(out)


def preview(text: str, limit: int = PREVIEW_CHARS) -> str:
    """One line of at most `limit` characters (see _clean)."""
    line = _clean(text)
    return line if len(line) <= limit else line[: limit - 1] + "…"


def ids_preview(ids: Sequence[int], limit: int = PREVIEW_CHARS) -> str:
    """A preview from token ids, for when no tokenizer is at hand."""
    return preview(" ".join(map(str, ids[:PREVIEW_TOKENS])), limit)


def edge_preview(tokens: Sequence[int], decode: Decode | None, limit: int = PREVIEW_CHARS) -> str:
    """Start and end of an edge ("<|im_start|>sy…you today?"): where a branch diverges and
    where it stops are what tell branches apart."""
    if decode is None:
        return ids_preview(tokens, limit)
    text = _clean(decode(tokens[:PREVIEW_TOKENS]))
    if len(tokens) <= PREVIEW_TOKENS and len(text) <= limit:
        return text
    tail = _clean(decode(tokens[-PREVIEW_TOKENS:]))
    head_chars = (limit - 1) // 2
    return text[:head_chars] + "…" + tail[-(limit - 1 - head_chars) :]


def distinct_offsets(seqs: Sequence[Sequence[int]]) -> list[int]:
    """For each sequence, how many leading tokens it shares with the most similar other one.
    In sorted order the most similar sequence is a neighbour, so this is one sort and a pass."""
    order = sorted(range(len(seqs)), key=lambda i: tuple(seqs[i]))
    out = [0] * len(seqs)
    for prev, cur in zip(order, order[1:], strict=False):
        a, b = seqs[prev], seqs[cur]
        n = min(len(a), len(b))
        shared = next((i for i in range(n) if a[i] != b[i]), n)
        out[prev] = max(out[prev], shared)
        out[cur] = max(out[cur], shared)
    return out


def distinct_preview(
    tokens: Sequence[int], shared: int, decode: Decode | None, limit: int = PREVIEW_CHARS
) -> str:
    """What sets a sequence apart from its most similar sibling: the text after the `shared`
    leading tokens, or its end when it is a prefix of another."""
    if shared >= len(tokens):
        return tail_preview(tokens, decode, limit)
    return edge_preview(tokens[shared:], decode, limit)


def tail_preview(tokens: Sequence[int], decode: Decode | None, limit: int = PREVIEW_CHARS) -> str:
    """The end of a sequence, where exact-index entries differ from each other."""
    tail = tokens[-PREVIEW_TOKENS:]
    text = ids_preview(tail, 10**6) if decode is None else preview(decode(tail), 10**6)
    return text if len(text) <= limit else "…" + text[-(limit - 1) :]


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
        {"n_tokens": len(e.tokens), "n_blocks": e.blocks, "has_logits": e.has_logits,
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
    the README). `snapshot_info` holds "path", "saved_at", "model_label" and "tokenizer_file";
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
