"""The disk tier's block store: keys, file format, write-behind, budget, damage, processes."""

from __future__ import annotations

import builtins
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvchat.cache.block_file import BlockLayout
from kvchat.cache.block_index import BLOCK_INDEX, block_path
from kvchat.cache.block_keys import block_keys, chain_keys, next_key, root_key
from kvchat.cache.block_store import BlockStore, ReadStatus, read_disk_tier

BS = 4
FP = {"model": "tiny", "config": "abc", "tokenizer": "def", "dtype": "float32", "block_size": BS}
LAYOUT = BlockLayout(n_layers=2, n_kv_heads=2, head_dim=4, block_size=BS, dtype="float32")
SHAPE = (LAYOUT.n_kv_heads, BS, LAYOUT.head_dim)
KVList = list[tuple[torch.Tensor, torch.Tensor]]


def make_kv(key: str, layout: BlockLayout = LAYOUT) -> KVList:
    """K/V that are a function of the key, so every process builds the same block."""
    gen = torch.Generator().manual_seed(int(key[:12], 16))
    dtype = getattr(torch, layout.dtype)
    shape = (layout.n_kv_heads, layout.block_size, layout.head_dim)
    return [(torch.randn(shape, generator=gen).to(dtype),
             torch.randn(shape, generator=gen).to(dtype)) for _ in range(layout.n_layers)]


def chain(n_blocks: int, namespace: str = "", offset: int = 100) -> list[tuple[str, list[int]]]:
    """Keys and tokens of n full blocks. Token ids of three digits: every file is the same size
    (its header lists the tokens)."""
    assert offset >= 100 and offset + n_blocks * BS <= 1000
    tokens = [offset + i for i in range(n_blocks * BS)]
    keys = block_keys(tokens, BS, root_key(FP, namespace))
    return [(k, tokens[i * BS : (i + 1) * BS]) for i, k in enumerate(keys)]


def assert_same(got: KVList | None, want: KVList) -> None:
    assert got is not None
    assert len(got) == len(want)
    for (gk, gv), (wk, wv) in zip(got, want, strict=True):
        assert gk.dtype == wk.dtype and tuple(gk.shape) == SHAPE
        # bit-exact: compare the raw bytes, not values within a tolerance
        assert torch.equal(gk.view(torch.uint8), wk.contiguous().view(torch.uint8))
        assert torch.equal(gv.view(torch.uint8), wv.contiguous().view(torch.uint8))


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(store_dir: Path) -> Iterator[BlockStore]:
    with BlockStore(store_dir, LAYOUT, 1 << 20) as s:
        yield s


def write_blocks(store: BlockStore, blocks: list[tuple[str, list[int]]]) -> None:
    for key, tokens in blocks:
        assert store.put(key, tokens, make_kv(key, store.layout))
    store.flush()


def file_size(store: BlockStore) -> int:
    """Every test block file has the same size (same layout, same token count)."""
    stats = store.stats()
    return stats.bytes // stats.blocks


# ---- keys ------------------------------------------------------------------------------------


def test_keys_chain_over_the_prefix() -> None:
    root = root_key(FP)
    tokens = list(range(5 * BS))
    keys = block_keys(tokens, BS, root)
    assert len(keys) == 5 and len(set(keys)) == 5
    assert keys == block_keys(list(tokens), BS, root_key(dict(FP)))  # same prefix, same keys
    assert block_keys(tokens + [7, 8], BS, root) == keys  # a longer sequence shares them
    changed = list(tokens)
    changed[2 * BS + 1] += 1  # a token of block 2
    other = block_keys(changed, BS, root)
    assert other[:2] == keys[:2]
    assert all(a != b for a, b in zip(other[2:], keys[2:], strict=True))
    # a chain is next_key applied block by block
    key = root
    for i, want in enumerate(keys):
        key = next_key(key, tokens[i * BS : (i + 1) * BS])
        assert key == want


def test_namespace_and_fingerprint_change_every_key() -> None:
    tokens = list(range(3 * BS + 2))
    base = chain_keys(tokens, BS, root_key(FP))
    for root in (root_key(FP, "tenant-a"), root_key({**FP, "dtype": "bfloat16"})):
        other = chain_keys(tokens, BS, root)
        assert not set(other.full) & set(base.full)
        assert other.partial != base.partial
    assert root_key(FP, "a") != root_key(FP, "b") != root_key(FP)


def test_partial_block_keys_include_their_length() -> None:
    root = root_key(FP)
    full = chain_keys(list(range(2 * BS)), BS, root)
    assert full.partial is None
    a = chain_keys(list(range(BS + 2)), BS, root)
    b = chain_keys(list(range(BS + 3)), BS, root)
    assert a.full == b.full == full.full[:1]
    assert a.partial is not None and b.partial is not None
    assert len({a.partial, b.partial, full.full[1]}) == 3
    # [0] + tail [0] differs from a two-token tail [0, 0]: lengths are part of the encoding
    assert next_key(root, [0]) != next_key(root, [0, 0])


# ---- round trip ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_bit_exact(store_dir: Path, dtype: str) -> None:
    layout = BlockLayout(2, 2, 4, BS, dtype)
    blocks = chain(3)
    kvs = {k: make_kv(k, layout) for k, _ in blocks}
    with BlockStore(store_dir, layout, 1 << 20) as store:
        for key, tokens in blocks:
            assert store.put(key, tokens, kvs[key])
        queued = store.get(blocks[0][0])  # may come from the write queue
        assert queued.status is ReadStatus.HIT
        assert_same(queued.kv, kvs[blocks[0][0]])
    with BlockStore(store_dir, layout, 1 << 20) as store:  # from the files
        for key, tokens in blocks:
            got = store.get(key)
            assert got.status is ReadStatus.HIT and got.notice is None
            assert got.tokens == tuple(tokens)
            assert_same(got.kv, kvs[key])
        assert store.stats().reads == 3 and store.stats().read_failures == 0
    data = block_path(store_dir, blocks[0][0]).read_bytes()
    assert data[:4] == b"KVCB"
    header_len = int.from_bytes(data[6:10], "little")
    assert (10 + header_len) % 64 == 0  # the payload is aligned for tensors read in place
    assert json.loads(data[10 : 10 + header_len])["tokens"] == blocks[0][1]


def test_partial_block_round_trip_zeroes_unused_slots(store: BlockStore) -> None:
    chained = chain_keys([1, 2, 3, 4, 5, 6], BS, root_key(FP))
    assert chained.partial is not None
    kv = make_kv(chained.partial)
    store.put(chained.partial, [5, 6], kv)
    store.flush()
    got = store.get(chained.partial)
    assert got.status is ReadStatus.HIT and got.tokens == (5, 6) and got.kv is not None
    for (gk, gv), (wk, wv) in zip(got.kv, kv, strict=True):
        assert torch.equal(gk[:, :2], wk[:, :2]) and torch.equal(gv[:, :2], wv[:, :2])
        assert not gk[:, 2:].any() and not gv[:, 2:].any()


def test_put_copies_its_tensors(store: BlockStore) -> None:
    (key, tokens), = chain(1)
    kv = make_kv(key)
    want = [(k.clone(), v.clone()) for k, v in kv]
    # (1, H, bs, D), as export_blocks gives it, is accepted too
    assert store.put(key, tokens, [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in kv])
    for k, v in kv:  # the pool slot is reused at once
        k.fill_(9.0)
        v.fill_(9.0)
    assert_same(store.get(key).kv, want)
    store.flush()
    assert_same(store.get(key).kv, want)
    assert not store.put(key, tokens, kv)  # stored already: not written twice
    store.flush()
    assert store.stats().writes == 1


def test_put_checks_shape_and_dtype(store: BlockStore) -> None:
    (key, tokens), = chain(1)
    bad = [(k.double(), v.double()) for k, v in make_kv(key)]
    with pytest.raises(ValueError, match="float32"):
        store.put(key, tokens, bad)
    with pytest.raises(ValueError, match="block key"):
        store.put("not-a-key", tokens, make_kv(key))
    assert store.stats().pending == 0


def test_a_queued_block_is_served_before_it_is_written(store: BlockStore,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real = BlockStore._write_file

    def slow(self: BlockStore, tmp: Path, item: Any) -> int:
        assert release.wait(10)
        return real(self, tmp, item)

    monkeypatch.setattr(BlockStore, "_write_file", slow)
    (key, tokens), = chain(1)
    store.put(key, tokens, make_kv(key))
    got = store.get(key)
    assert got.status is ReadStatus.HIT and store.stats().pending == 1
    assert not block_path(store.root, key).exists()
    release.set()
    store.flush()
    assert block_path(store.root, key).exists() and store.stats().pending == 0


def test_concurrent_puts_write_each_block_once(store: BlockStore) -> None:
    blocks = chain(12)

    def worker() -> None:
        for key, tokens in blocks:
            store.put(key, tokens, make_kv(key))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.flush()
    stats = store.stats()
    assert stats.writes == stats.blocks == 12
    for key, _ in blocks:
        assert_same(store.get(key).kv, make_kv(key))


def test_store_off_touches_nothing(store_dir: Path) -> None:
    (key, tokens), = chain(1)
    with BlockStore(store_dir, LAYOUT, 0) as store:
        assert not store.enabled
        assert not store.put(key, tokens, make_kv(key))
        assert store.get(key).status is ReadStatus.MISSING
        assert not store.exists(key)
    assert not store_dir.exists()


def test_blocks_go_from_one_pool_to_another(store: BlockStore) -> None:
    from kvchat.cache.blocks import BlockManager

    def pool() -> BlockManager:
        return BlockManager(8, BS, LAYOUT.n_layers, LAYOUT.n_kv_heads, LAYOUT.head_dim)

    src = pool()
    tokens = [100 + i for i in range(2 * BS + 1)]
    blocks = src.allocate(3)
    kv = [(torch.randn(1, 2, len(tokens), 4), torch.randn(1, 2, len(tokens), 4))
          for _ in range(LAYOUT.n_layers)]
    src.write([b.block_id for b in blocks], 0, kv)
    chained = chain_keys(tokens, BS, root_key(FP))
    keys = [*chained.full, chained.partial]
    for i, (key, block) in enumerate(zip(keys, blocks, strict=True)):
        assert key is not None
        store.put(key, tokens[i * BS : (i + 1) * BS], src.block_tensors(block.block_id))
    store.flush()
    reads = [store.get(k) for k in keys if k is not None]
    assert all(r.status is ReadStatus.HIT and r.kv is not None for r in reads)
    dst = pool()
    dst.allocate(2)  # land elsewhere than in the source pool
    per_layer = [(torch.stack([r.kv[layer][0] for r in reads if r.kv]),
                  torch.stack([r.kv[layer][1] for r in reads if r.kv]))
                 for layer in range(LAYOUT.n_layers)]
    records = [{"last_accessed": 0, "attn_score": 0.0} for _ in reads]
    loaded = dst.import_blocks(records, per_layer)
    got = dst.gather([b.block_id for b in loaded], len(tokens))
    want = src.gather([b.block_id for b in blocks], len(tokens))
    for (gk, gv), (wk, wv) in zip(got, want, strict=True):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)


def test_a_failed_write_is_a_notice_not_a_crash(store: BlockStore,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(self: BlockStore, tmp: Path, item: Any) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(BlockStore, "_write_file", full_disk)
    (key, tokens), = chain(1)
    assert store.put(key, tokens, make_kv(key))
    store.flush()
    notices = store.take_notices()
    assert len(notices) == 1 and "No space left" in notices[0]
    assert store.stats().write_failures == 1 and store.stats().blocks == 0
    assert store.get(key).status is ReadStatus.MISSING
    assert list(store.root.rglob("*.tmp")) == []


def test_an_empty_store_writes_an_empty_index(store_dir: Path) -> None:
    with BlockStore(store_dir, LAYOUT, 1 << 20):
        pass
    assert json.loads((store_dir / BLOCK_INDEX).read_text())["entries"] == {}
    assert read_disk_tier(store_dir).to_json() == {"blocks": 0, "bytes": 0,
                                                   "budget_bytes": 1 << 20}


# ---- damage ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["header", "payload", "checksum"])
def test_flipped_byte_is_detected_and_quarantined(store: BlockStore, where: str) -> None:
    blocks = chain(2)
    write_blocks(store, blocks)
    key = blocks[0][0]
    path = block_path(store.root, key)
    data = bytearray(path.read_bytes())
    at = {"header": 30, "payload": len(data) // 2, "checksum": len(data) - 1}[where]
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    got = store.get(key)
    assert got.status is ReadStatus.CORRUPT and got.kv is None
    assert got.notice is not None and key[:12] in got.notice and "quarantine" in got.notice
    assert not path.exists()
    assert len(list((store.root / "quarantine").iterdir())) == 1
    assert store.stats().read_failures == 1 and not store.exists(key)
    assert store.get(key).status is ReadStatus.MISSING  # never served afterwards
    assert store.get(blocks[1][0]).status is ReadStatus.HIT  # the others are unharmed


def test_truncated_file_is_detected(store: BlockStore) -> None:
    (key, tokens), = chain(1)
    write_blocks(store, [(key, tokens)])
    path = block_path(store.root, key)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    got = store.get(key)
    assert got.status is ReadStatus.CORRUPT and got.notice is not None
    assert "truncated" in got.notice
    assert store.stats().blocks == 0


def test_a_file_holding_another_key_is_not_served(store: BlockStore) -> None:
    (a, ta), (b, tb) = chain(2)
    write_blocks(store, [(a, ta), (b, tb)])
    os.replace(block_path(store.root, a), block_path(store.root, b))
    got = store.get(b)
    assert got.status is ReadStatus.CORRUPT and got.notice and "another block" in got.notice


def test_missing_file_is_a_miss(store: BlockStore) -> None:
    (key, tokens), = chain(1)
    write_blocks(store, [(key, tokens)])
    block_path(store.root, key).unlink()
    got = store.get(key)
    assert got.status is ReadStatus.MISSING and got.kv is None
    assert got.notice and "gone" in got.notice
    assert store.stats().blocks == 0 and store.stats().read_failures == 0
    never = chain(1, offset=600)[0][0]
    assert store.get(never) == (None, ReadStatus.MISSING, (), None)  # a plain miss: no notice


# ---- budget ----------------------------------------------------------------------------------


def test_budget_evicts_least_recently_used(store_dir: Path) -> None:
    a, b, c, d, e = chain(5)
    with BlockStore(store_dir, LAYOUT, 1 << 20) as probe:
        write_blocks(probe, [a])
        size = file_size(probe)
    budget = 3 * size + size // 2  # room for three files
    with BlockStore(store_dir, LAYOUT, budget) as store:
        write_blocks(store, [b, c])  # a (from before), b, c
        assert store.get(a[0]).status is ReadStatus.HIT  # a is now the most recent
        write_blocks(store, [d])  # b goes: least recently used
        assert not block_path(store_dir, b[0]).exists()
        assert store.put(c[0], c[1], make_kv(c[0])) is False  # stored: only marked as used
        write_blocks(store, [e])  # a goes: c was used after it
        present = {k for k, _ in (a, b, c, d, e) if block_path(store_dir, k).exists()}
        assert present == {c[0], d[0], e[0]}
        stats = store.stats()
        assert stats.evictions == 2 and stats.bytes <= budget and stats.blocks == 3
    assert read_disk_tier(store_dir).to_json() == {"blocks": 3, "bytes": 3 * size,
                                                   "budget_bytes": budget}


def test_a_block_being_read_is_not_evicted(store_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import kvchat.cache.block_store as store_module

    a, b, c = chain(3)
    with BlockStore(store_dir, LAYOUT, 1 << 20) as probe:
        write_blocks(probe, [a, b])
        size = file_size(probe)
    real_read = store_module.read_block_bytes
    with BlockStore(store_dir, LAYOUT, 2 * size + size // 2) as store:
        store.flush()

        def read_while_writing(path: Path) -> bytearray:
            if path.name.startswith(a[0]):  # a, the least recently used, is being read
                write_blocks(store, [c])  # over budget: b must go instead
            return real_read(path)

        monkeypatch.setattr(store_module, "read_block_bytes", read_while_writing)
        assert store.get(a[0]).status is ReadStatus.HIT
        assert not block_path(store_dir, b[0]).exists()
        assert block_path(store_dir, c[0]).exists()


# ---- start-up and the index ------------------------------------------------------------------


def test_start_up_reads_the_index_only(store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = chain(6)
    with BlockStore(store_dir, LAYOUT, 1 << 20) as store:
        write_blocks(store, blocks)
    real_open, real_os_open = builtins.open, os.open

    def no_block_files(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith(".kvb"):
            raise AssertionError(f"start-up opened {path}")
        return real_open(path, *args, **kwargs)

    def no_block_fds(path: Any, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(".kvb"):
            raise AssertionError(f"start-up opened {path}")
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_block_files)
    monkeypatch.setattr(os, "open", no_block_fds)
    with BlockStore(store_dir, LAYOUT, 1 << 20) as store:
        store.flush()  # the reconciliation has run too
        assert store.stats().blocks == 6 and store.take_notices() == []
        assert all(store.exists(k) for k, _ in blocks)
        assert read_disk_tier(store_dir).blocks == 6
        monkeypatch.undo()
        assert store.get(blocks[3][0]).status is ReadStatus.HIT


@pytest.mark.parametrize("damage", ["missing", "garbage"])
def test_index_is_rebuilt_from_the_files(store_dir: Path, damage: str) -> None:
    blocks = chain(4)
    with BlockStore(store_dir, LAYOUT, 1 << 20) as store:
        write_blocks(store, blocks)
        size = file_size(store)
    index = store_dir / BLOCK_INDEX
    if damage == "missing":
        index.unlink()
    else:
        index.write_text("{not json")
    assert read_disk_tier(store_dir).blocks == 0  # inspect reads it as empty, no crash
    with BlockStore(store_dir, LAYOUT, 1 << 20) as store:
        store.flush()
        assert store.stats().blocks == 4 and store.stats().bytes == 4 * size
        notices = store.take_notices()
        assert (len(notices) == 1 and "rebuilt" in notices[0]) == (damage == "garbage")
    assert read_disk_tier(store_dir).blocks == 4


def test_index_entries_without_files_are_dropped_and_unlisted_files_adopted(
        store_dir: Path) -> None:
    blocks = chain(4)
    with BlockStore(store_dir, LAYOUT, 1 << 20) as store:
        write_blocks(store, blocks[:3])
    block_path(store_dir, blocks[0][0]).unlink()  # listed, no file
    elsewhere = store_dir.parent / "elsewhere"
    with BlockStore(elsewhere, LAYOUT, 1 << 20) as other:  # a file nobody listed
        write_blocks(other, blocks[3:])
    os.replace(block_path(elsewhere, blocks[3][0]), _mkparent(store_dir, blocks[3][0]))
    with BlockStore(store_dir, LAYOUT, 1 << 20) as store:
        store.flush()
        assert store.take_notices() == ["1 block(s) listed in the disk cache's index had no "
                                        "file; dropped from it."]
        assert store.stats().blocks == 3
        assert store.get(blocks[3][0]).status is ReadStatus.HIT
    listed = json.loads((store_dir / BLOCK_INDEX).read_text())["entries"]
    assert set(listed) == {k for k, _ in blocks[1:]}


def test_put_rewrites_a_listed_block_whose_file_vanished(store: BlockStore) -> None:
    (key, tokens), = chain(1)
    write_blocks(store, [(key, tokens)])
    block_path(store.root, key).unlink()  # another process evicted it
    assert store.put(key, tokens, make_kv(key))
    store.flush()
    assert store.stats().writes == 2 and store.stats().blocks == 1
    assert_same(store.get(key).kv, make_kv(key))


def _mkparent(root: Path, key: str) -> Path:
    path = block_path(root, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def test_two_stores_on_one_dir_see_each_others_blocks(store_dir: Path) -> None:
    first, second = chain(3), chain(2, offset=500)
    with BlockStore(store_dir, LAYOUT, 1 << 20) as a, BlockStore(store_dir, LAYOUT, 1 << 20) as b:
        write_blocks(a, first)
        write_blocks(b, second)
        # b's flush saved b's index, adopting what a's index listed (their files exist)
        assert b.stats().blocks == 5 and b.get(first[1][0]).status is ReadStatus.HIT
        late = chain(1, offset=700)
        write_blocks(a, late)  # b does not know of it until it looks
        assert b.stats().blocks == 5 and b.exists(late[0][0]) and b.stats().blocks == 6
        a.close()
    listed = json.loads((store_dir / BLOCK_INDEX).read_text())["entries"]
    assert set(listed) == {k for k, _ in first + second + late}


def test_file_modes_are_private_whatever_the_umask(store_dir: Path) -> None:
    old = os.umask(0)
    try:
        blocks = chain(2)
        with BlockStore(store_dir, LAYOUT, 1 << 20) as store:
            write_blocks(store, blocks)
            path = block_path(store_dir, blocks[0][0])
            path.write_bytes(b"KVCB damaged")
            assert store.get(blocks[0][0]).status is ReadStatus.CORRUPT
    finally:
        os.umask(old)
    for item in [store_dir, *store_dir.rglob("*")]:
        mode = stat.S_IMODE(item.stat().st_mode)
        assert mode == (0o700 if item.is_dir() else 0o600), f"{item}: {oct(mode)}"


def test_index_and_stats_import_no_torch() -> None:
    code = ("import sys; import kvchat.cache.block_store, kvchat.cache.block_index, "
            "kvchat.cache.block_keys; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- several processes -----------------------------------------------------------------------

WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from test_block_store import LAYOUT, chain, make_kv
    from kvchat.cache.block_store import BlockStore
    root, n, order = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    blocks = chain(n)
    if order == "reverse":
        blocks.reverse()
    store = BlockStore(root, LAYOUT, 1 << 30)
    for key, tokens in blocks:
        store.put(key, tokens, make_kv(key))
    print("queued", flush=True)
    if order == "hang":
        time.sleep(60)  # killed meanwhile
    store.close()
""")


def run_writer(root: Path, n: int, order: str) -> subprocess.Popen[str]:
    script = WRITER.format(tests=str(Path(__file__).parent))
    return subprocess.Popen([sys.executable, "-c", script, str(root), str(n), order],
                            stdout=subprocess.PIPE, text=True)


def test_two_processes_writing_the_same_blocks(store_dir: Path) -> None:
    procs = [run_writer(store_dir, 40, order) for order in ("forward", "reverse")]
    for proc in procs:
        assert proc.wait(timeout=60) == 0
    temps = [p for p in store_dir.rglob("*.tmp")]
    assert temps == []
    blocks = chain(40)
    with BlockStore(store_dir, LAYOUT, 1 << 30) as store:
        store.flush()
        assert store.stats().blocks == 40 and store.take_notices() == []
        for key, tokens in blocks:
            got = store.get(key)
            assert got.status is ReadStatus.HIT and got.tokens == tuple(tokens)
            assert_same(got.kv, make_kv(key))
    listed = json.loads((store_dir / BLOCK_INDEX).read_text())["entries"]
    assert set(listed) == {k for k, _ in blocks}


def test_sigkill_during_write_behind_leaves_a_consistent_store(store_dir: Path) -> None:
    proc = run_writer(store_dir, 150, "hang")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "queued"
    os.kill(proc.pid, signal.SIGKILL)  # the queue is being written
    proc.wait(timeout=30)
    blocks = dict(chain(150))
    # an orphan of the dead writer, and a live writer's temp file, which must be left alone
    dead = _mkparent(store_dir, "ab" * 32).with_name(f".{'ab' * 32}.kvb.{proc.pid}-1.tmp")
    live = dead.with_name(f".{'cd' * 32}.kvb.{os.getpid()}-1.tmp")
    dead.write_bytes(b"KVCB half")
    live.write_bytes(b"KVCB half")
    with BlockStore(store_dir, LAYOUT, 1 << 30) as store:
        store.flush()
        assert list(store_dir.rglob("*.tmp")) == [live]  # the kill's own orphan is gone too
        on_disk = {p.name.removesuffix(".kvb") for p in store_dir.rglob("*.kvb")}
        assert on_disk <= blocks.keys()
        assert store.stats().blocks == len(on_disk)
        for key in on_disk:
            got = store.get(key)
            assert got.status is ReadStatus.HIT, got.notice
            assert got.tokens == tuple(blocks[key])
            assert_same(got.kv, make_kv(key))
    live.unlink()
    listed = json.loads((store_dir / BLOCK_INDEX).read_text())["entries"]
    assert set(listed) == on_disk
