"""The cache's state as plain data plus tensors, for the on-disk snapshot.

`export_state` returns (meta, tensors): meta is JSON-ready (tree, blocks' tokens and policy
metadata, exact entries, counters, the policy's state) and readable without torch by
`kvchat inspect`; tensors hold the used blocks' K/V, packed densely in snapshot order, and the
exact entries' logits. `import_state` rebuilds the same cache in a fresh one of the same shape.
Both go through the public methods of the pool, the tree, the exact index and the policy.

Version 1 snapshots written before "policy_state" existed still load: the LRU clock then
resumes after the newest block stamp. Those written before namespaces existed load into
namespace "" (tree records and exact entries without a "namespace").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvchat.cache.stats import Counters
from kvchat.cache.tree_index import SnapshotMismatch, export_blocks, tree_from_blocks

if TYPE_CHECKING:
    from kvchat.cache.kvcache import PagedKVCache

SNAPSHOT_VERSION = 1

__all__ = ["SNAPSHOT_VERSION", "SnapshotMismatch", "export_state", "import_state"]




def export_state(cache: PagedKVCache) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    mgr = cache.manager
    order, tree = export_blocks(cache.tree)
    index = {b.block_id: i for i, b in enumerate(order)}
    exact = []
    tensors: dict[str, torch.Tensor] = {}
    for i, (key, entry) in enumerate(cache.exact.items()):
        name = None
        if entry.logits is not None:
            name = f"logits.{i}"
            tensors[name] = entry.logits.detach().to("cpu").contiguous()
        exact.append(
            {"tokens": list(key), "blocks": [index[b.block_id] for b in entry.blocks],
             "logits": name, "namespace": entry.namespace}
        )
    for layer, (k, v) in enumerate(mgr.export_blocks([b.block_id for b in order])):
        tensors[f"k.{layer}"], tensors[f"v.{layer}"] = k, v
    meta = {
        "version": SNAPSHOT_VERSION,
        "block_size": cache.block_size,
        "shape": [mgr.n_layers, mgr.n_kv_heads, mgr.head_dim],
        "policy": cache.policy.name,
        "policy_state": cache.policy.state(),
        "blocks": [b.record() for b in order],
        "tree": tree,
        "exact": exact,
        "counters": cache.stats().counters_json(),
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
        cache.reset()
        raise
    except (KeyError, IndexError, TypeError, ValueError, AssertionError, RuntimeError) as exc:
        cache.reset()
        raise SnapshotMismatch(f"the snapshot is damaged ({type(exc).__name__}: {exc})") from exc


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
    kv = [(tensors[f"k.{layer}"], tensors[f"v.{layer}"]) for layer in range(mgr.n_layers)]
    blocks = mgr.import_blocks(records, kv)
    cache.restore(tree_from_blocks(cache.new_tree(), meta["tree"], blocks),
                  Counters.counters_from_json(meta["counters"]))
    for rec in meta["exact"]:
        logits = tensors[rec["logits"]] if rec["logits"] else None
        if logits is not None:
            logits = logits.to(mgr.devices[-1])
        cache.exact.put(rec["tokens"], [blocks[i] for i in rec["blocks"]], logits,
                        str(rec.get("namespace", "")))
    # older snapshots carry no policy state: the logical clock resumes after the newest stamp
    newest = max((b.last_accessed for b in blocks), default=0)
    cache.policy.restore(meta.get("policy_state") or {"clock": newest})
    cache.check_integrity()
