"""The cache's state as plain data plus tensors, for the on-disk snapshot.

`export_state` returns (meta, tensors): meta is JSON-ready (tree, blocks' tokens and policy
metadata, exact entries, counters) and readable without torch by `kvchat inspect`; tensors hold the
used blocks' K/V, packed densely in snapshot order, and the exact entries' logits.
`import_state` rebuilds the same tree in a fresh cache of the same shape.
"""

from __future__ import annotations

from typing import Any

import torch

from kvchat.cache.blocks import Block
from kvchat.cache.kvcache import Counters, PagedKVCache, SessionCounters
from kvchat.cache.radix import Node

SNAPSHOT_VERSION = 1


class SnapshotMismatch(ValueError):
    """The snapshot does not fit this cache (shape, size or version)."""


def export_state(cache: PagedKVCache) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    mgr = cache.manager
    order: list[Block] = list(cache.tree.all_blocks())
    index = {b.block_id: i for i, b in enumerate(order)}

    def node_dict(node: Node) -> dict[str, Any]:
        return {
            "start": node.start,
            "blocks": [index[b.block_id] for b in node.blocks],
            "owners": sorted(node.owners),
            "children": [node_dict(c) for c in node.child_list()],
        }

    exact = []
    tensors: dict[str, torch.Tensor] = {}
    for i, (key, entry) in enumerate(cache.exact.items()):
        name = None
        if entry.logits is not None:
            name = f"logits.{i}"
            tensors[name] = entry.logits.detach().to("cpu").contiguous()
        exact.append(
            {"tokens": list(key), "blocks": [index[b.block_id] for b in entry.blocks],
             "logits": name}
        )
    ids = torch.tensor([b.block_id for b in order], dtype=torch.long)
    for layer in range(mgr.n_layers):
        dev_ids = ids.to(mgr.devices[layer])
        tensors[f"k.{layer}"] = mgr.k_pool[layer][dev_ids].to("cpu").contiguous()
        tensors[f"v.{layer}"] = mgr.v_pool[layer][dev_ids].to("cpu").contiguous()
    c = cache.counters
    meta = {
        "version": SNAPSHOT_VERSION,
        "block_size": cache.block_size,
        "shape": [mgr.n_layers, mgr.n_kv_heads, mgr.head_dim],
        "policy": cache.policy.name,
        "blocks": [
            {"tokens": b.token_ids, "last_accessed": b.last_accessed, "attn_score": b.attn_score}
            for b in order
        ],
        "tree": [node_dict(child) for child in cache.tree.root.child_list()],
        "exact": exact,
        "counters": {
            "hit_count": c.hit_count,
            "miss_count": c.miss_count,
            "exact_hits": c.exact_hits,
            "hit_tokens": c.hit_tokens,
            "lookup_tokens": c.lookup_tokens,
            "eviction_count": c.eviction_count,
            "stored_tokens": c.stored_tokens,
            "sessions": {sid: vars(s) for sid, s in c.sessions.items()},
        },
    }
    return meta, tensors


def import_state(
    cache: PagedKVCache, meta: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> None:
    """Load a snapshot into an empty cache; raises SnapshotMismatch if it cannot fit or does
    not hold together, leaving the cache empty."""
    try:
        _import(cache, meta, tensors)
    except SnapshotMismatch:
        _reset(cache)
        raise
    except (KeyError, IndexError, TypeError, ValueError, AssertionError, RuntimeError) as exc:
        _reset(cache)
        raise SnapshotMismatch(f"the snapshot is damaged ({type(exc).__name__}: {exc})") from exc


def _reset(cache: PagedKVCache) -> None:
    cache.tree.clear()
    cache.exact.clear()
    cache.counters = Counters()
    mgr = cache.manager
    for block in mgr.blocks:
        if not mgr.is_free(block.block_id):
            block.ref_count = 0
            mgr.free([block])


def _import(cache: PagedKVCache, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    mgr = cache.manager
    if meta.get("version") != SNAPSHOT_VERSION:
        raise SnapshotMismatch(f"snapshot version {meta.get('version')} is not {SNAPSHOT_VERSION}")
    if meta["block_size"] != cache.block_size:
        raise SnapshotMismatch("block size differs")
    if list(meta["shape"]) != [mgr.n_layers, mgr.n_kv_heads, mgr.head_dim]:
        raise SnapshotMismatch("K/V shape differs")
    if mgr.num_free != mgr.num_blocks:
        raise SnapshotMismatch("the cache is not empty")
    records = meta["blocks"]
    if len(records) > mgr.num_blocks:
        raise SnapshotMismatch(
            f"the snapshot holds {len(records)} blocks but the pool has {mgr.num_blocks}; "
            "raise --cache-mb to load it"
        )
    blocks = mgr.allocate(len(records))
    for block, rec in zip(blocks, records, strict=True):
        block.release()  # tree ownership holds no reference
        block.token_ids = list(rec["tokens"])
        block.last_accessed = int(rec["last_accessed"])
        block.attn_score = float(rec["attn_score"])
    ids = torch.tensor([b.block_id for b in blocks], dtype=torch.long)
    for layer in range(mgr.n_layers):
        dev = mgr.devices[layer]
        dev_ids = ids.to(dev)
        mgr.k_pool[layer][dev_ids] = tensors[f"k.{layer}"].to(dev, mgr.dtype)
        mgr.v_pool[layer][dev_ids] = tensors[f"v.{layer}"].to(dev, mgr.dtype)

    tree = cache.tree

    def build(rec: dict[str, Any], parent: Node) -> None:
        own = [blocks[i] for i in rec["blocks"]]
        tokens = [t for b in own for t in b.token_ids]
        node = Node(parent, int(rec["start"]), tokens, own)
        node.owners = set(rec.get("owners", []))
        if node.start == 0 and own:
            own[0].is_first_block = True
        parent.add_child(node)
        for child in rec["children"]:
            build(child, node)
        if not rec["children"]:
            tree._leaves.add(node)

    for rec in meta["tree"]:
        build(rec, tree.root)
    for rec in meta["exact"]:
        logits = tensors[rec["logits"]] if rec["logits"] else None
        if logits is not None:
            logits = logits.to(mgr.devices[-1])
        cache.exact.put(rec["tokens"], [blocks[i] for i in rec["blocks"]], logits)
    saved = dict(meta["counters"])
    sessions = {sid: SessionCounters(**v) for sid, v in saved.pop("sessions", {}).items()}
    cache.counters = Counters(**saved, sessions=sessions)
    # logical LRU clocks continue after the restored stamps
    clock = max((b.last_accessed for b in blocks), default=0)
    if hasattr(cache.policy, "_clock"):
        cache.policy._clock = max(getattr(cache.policy, "_clock"), clock)  # noqa: B009
    cache.check_integrity()
