"""One reader of the snapshot's tree index: `kvchat inspect`'s documents, the snapshot's own
summary and the cache's restore all read index.json's tree through `tree_index.read_tree`, so
they agree on what it holds and refuse the same damage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cache_helpers import make_tiered_cache, store

from kvchat.cache.state import SnapshotMismatch, records_of
from kvchat.cache.tree_index import (
    SnapshotFormatError,
    import_index,
    read_tree,
    walk_records,
)
from kvchat.inspect import documents
from kvchat.snapshots import read_snapshot_meta, save_snapshot

BS = 4
A = list(range(1, 15))
B = [*range(1, 9), 40, 41, 42, 43, 44]


def saved(root: Path) -> dict:
    cache = make_tiered_cache(root / "store", num_blocks=8, block_size=BS)
    store(cache, A, sid="s1")
    store(cache, B, sid="s2")
    cache.pin(A[:8])
    save_snapshot(root, cache, {"model": "test"}, {})
    records = records_of(cache.tree, cache.pins.block_ids)
    info = read_snapshot_meta(root)
    assert info is not None
    assert read_tree(info.meta) == records  # what was written is what is read
    assert cache.disk is not None
    cache.disk.close()
    return info.meta


def test_inspect_and_the_snapshot_read_the_same_records(tmp_path: Path) -> None:
    meta = saved(tmp_path)
    records = list(walk_records(read_tree(meta)))
    nodes = list(documents.walk(documents.nodes_from_meta(meta)))
    assert [(n.start, n.tokens, n.blocks, n.owners, n.namespace, n.pinned) for n in nodes] == [
        (r.start, r.tokens, r.blocks, r.owners, r.namespace, r.pinned) for r in records]
    assert any(n.pinned for n in nodes) and {o for n in nodes for o in n.owners} == {"s1", "s2"}
    info = read_snapshot_meta(tmp_path)
    assert info is not None
    assert info.cached_tokens == sum(len(r.tokens) for r in records) == len(A) + len(B) - 8


def test_damaged_records_are_refused_alike_by_every_reader(tmp_path: Path) -> None:
    meta = saved(tmp_path)
    del meta["tree"][0]["children"][0]["keys"]  # a node below the first loses its keys
    (tmp_path / "cache" / "index.json").write_text(json.dumps(meta))
    with pytest.raises(SnapshotFormatError, match="does not describe a cache"):
        read_tree(meta)
    with pytest.raises(SnapshotFormatError, match="does not describe a cache"):
        documents.nodes_from_meta(meta)
    info = read_snapshot_meta(tmp_path)
    assert info is not None
    with pytest.raises(ValueError, match="does not describe a cache"):
        info.cached_tokens  # noqa: B018
    cache = make_tiered_cache(tmp_path / "store", num_blocks=8, block_size=BS)
    with pytest.raises(SnapshotMismatch, match="does not describe a cache"):
        import_index(cache, meta)
    assert cache.tree.num_tokens == 0
    cache.check_integrity()
    assert cache.disk is not None
    cache.disk.close()


def test_a_version_1_index_still_reads_for_inspect() -> None:
    meta = {"version": 1, "blocks": [{"tokens": [1, 2, 3, 4]}, {"tokens": [5, 6]}],
            "tree": [{"start": 0, "blocks": [0, 1], "owners": ["s"], "children": []}]}
    (rec,) = read_tree(meta)
    assert (rec.tokens, rec.blocks, rec.keys, rec.owners) == ((1, 2, 3, 4, 5, 6), 2, (), ("s",))
    (node,) = documents.nodes_from_meta(meta)
    assert (node.tokens, node.blocks) == (rec.tokens, 2)
