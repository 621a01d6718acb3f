"""A block store several instances share: one instance's blocks are another's shared hits, found
by their chained keys, verified like any read, and kept apart by namespace and model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from _cache_helpers import fetch, make_tiered_cache, ref_kv, store

from kvchat.cache.block_index import block_path
from kvchat.cache.block_keys import chain_keys
from kvchat.cache.kvcache import PagedKVCache
from kvchat.cache.lookup import HitSource

BS = 4
T = list(range(1, 15))  # 14 tokens: 3 full blocks and a partial one


def pair(root: Path, **kw: object) -> tuple[PagedKVCache, PagedKVCache]:
    """Two caches (two instances) on one store folder."""
    return (make_tiered_cache(root, block_size=BS, shared=True, **kw),  # type: ignore[arg-type]
            make_tiered_cache(root, block_size=BS, shared=True, **kw))  # type: ignore[arg-type]


def close(*caches: PagedKVCache) -> None:
    for cache in caches:
        assert cache.disk is not None
        cache.disk.close()


def test_a_prefix_stored_on_one_instance_is_a_shared_hit_on_the_other(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    store(a, T)
    assert a.disk is not None
    a.disk.flush()
    assert a.disk.stats().writes == 3  # written through at once, full blocks only
    hit = fetch(b, T + [99])  # fetch checks the K/V against the reference
    assert (hit.source, hit.matched, hit.shared_tokens, hit.disk_tokens) == \
        (HitSource.SHARED, 12, 12, 0)
    again = fetch(b, T + [99])
    assert again.source is HitSource.RADIX and again.shared_tokens == 0  # resident on b now
    stats = b.stats()
    assert (stats.shared_hits, stats.shared_hit_tokens, stats.memory_hit_tokens) == (1, 12, 12)
    close(a, b)


def test_shared_blocks_extend_what_the_instance_already_holds(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    store(a, T)
    store(b, T[:5])  # b's own: one full block and one token
    assert a.disk is not None
    a.disk.flush()
    hit = fetch(b, T)
    assert hit.matched == 12 and hit.shared_tokens == 7 and hit.source is HitSource.SHARED
    b.check_integrity()
    close(a, b)


def test_shared_blocks_branch_off_where_the_instance_diverged(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    store(a, T)
    store(b, T[:6] + [77, 78, 79])  # b diverges inside block 1
    assert a.disk is not None
    a.disk.flush()
    hit = fetch(b, T)
    assert hit.matched == 12 and hit.shared_tokens == 6
    assert fetch(b, T[:6] + [77, 78, 79, 80]).matched == 9  # b's own branch is intact
    close(a, b)


def test_a_spill_on_one_instance_is_a_hit_on_the_other(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    store(a, T)
    a.evict(16)  # a keeps them on disk only
    assert a.disk is not None
    a.disk.flush()
    assert fetch(b, T).shared_tokens == 12
    assert fetch(a, T).source is HitSource.DISK  # a's own spill stays a disk hit for a
    close(a, b)


def test_tenants_and_models_never_share_blocks(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    other_model = make_tiered_cache(tmp_path, block_size=BS, shared=True, namespace_fp="other")
    a.write_kv(T, ref_kv(T), 0, namespace="tenant-1")
    assert a.disk is not None
    a.disk.flush()
    assert b.lookup(T, namespace="tenant-2").matched == 0
    assert other_model.lookup(T, namespace="tenant-1").matched == 0
    hit = b.lookup(T, namespace="tenant-1")
    assert hit.matched == 12 and hit.source is HitSource.SHARED
    b.release(hit.blocks)
    close(a, b, other_model)


def test_a_store_not_marked_shared_is_never_probed(tmp_path: Path) -> None:
    a = make_tiered_cache(tmp_path, block_size=BS, shared=True)
    b = make_tiered_cache(tmp_path, block_size=BS)
    store(a, T)
    assert a.disk is not None
    a.disk.flush()
    assert fetch(b, T).matched == 0
    store(b, [7, 7, 7, 7, 7])
    assert b.disk is not None
    b.disk.flush()
    assert b.disk.stats().writes == 0  # nothing written through either
    close(a, b)


def test_a_damaged_shared_block_is_never_served(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    store(a, T)
    assert a.disk is not None and b.disk is not None
    a.disk.flush()
    keys = chain_keys(T, BS, b.tree.root_key("")).full
    path = block_path(tmp_path, keys[1])
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF
    path.write_bytes(bytes(data))
    hit = fetch(b, T)
    assert hit.matched == 4 and hit.shared_tokens == 4  # the first block only
    assert any("not used" in line for line in b.take_notices())
    close(a, b)


# ---- two processes on one folder -----------------------------------------------------------

WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from _cache_helpers import make_tiered_cache, store
    cache = make_tiered_cache(Path(sys.argv[1]), num_blocks=64, block_size=4, shared=True)
    for i in range(10_000):  # killed meanwhile
        store(cache, [1000 + i % 7] + list(range(1, 30)) + [i])
        cache.disk.flush()
        if i == 3:
            print("written", flush=True)
""")


def test_one_process_reads_what_another_writes_and_survives_its_kill(tmp_path: Path) -> None:
    script = WRITER.format(tests=str(Path(__file__).parent))
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    reader = make_tiered_cache(tmp_path, num_blocks=64, block_size=BS, shared=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
        prompt = [1000] + list(range(1, 30)) + [99]
        hit = fetch(reader, prompt)  # K/V checked against the reference while it writes
        assert hit.matched == 28 and hit.source is HitSource.SHARED
        os.kill(proc.pid, signal.SIGKILL)  # mid-run: perhaps mid-file
        proc.wait(timeout=30)
        for g in range(7):  # every block the dead writer left is whole, or absent
            got = fetch(reader, [1000 + g] + list(range(1, 30)) + [99])
            assert got.matched in (0, 4, 8, 12, 16, 20, 24, 28)
        assert not [n for n in reader.take_notices() if "not used" in n]
    finally:
        if proc.poll() is None:
            proc.kill()
        close(reader)


def test_interleaved_stores_and_shared_hits_leave_a_consistent_cache(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    for i in range(6):
        store(a, [i % 3, *T, i])
        fetch(b, [i % 3, *T, 50 + i])
        b.check_integrity()
    close(a, b)
