"""The disk tier inside the cache: evicted blocks spill to a BlockStore, stay in the tree, and
come back on a hit (HitSource.DISK) with the K/V they had; damaged files are never served."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _cache_helpers import fetch, make_tiered_cache, store
from conftest import make_runtime

from kvchat.cache.block_index import block_path
from kvchat.cache.explain import MissReason
from kvchat.cache.lookup import HitSource
from kvchat.cache.tree_index import exact_logits, export_index, import_index
from kvchat.cache.visibility import Visibility
from kvchat.config import CacheConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.sequence import GenerationResult, Request
from kvchat.engine.verify import compare
from kvchat.inspect import documents as cv
from kvchat.responses import result_fields
from kvchat.runtime import Runtime, RuntimeOptions
from kvchat.ui import views

BS = 4
A = list(range(1, 15))  # 14 tokens: 3 full blocks and a partial one
B = [*range(1, 9), 40, 41, 42, 43, 44]  # shares two blocks with A


def test_evicted_blocks_spill_to_disk_and_a_lookup_loads_them_back(tmp_path: Path) -> None:
    cache = make_tiered_cache(tmp_path, num_blocks=8, block_size=BS)
    store(cache, A)
    store(cache, B)
    assert cache.evict(8) == 6  # every block: now only on disk
    assert cache.manager.num_free == 8
    assert cache.stats().disk_tokens == len(A) + len(B) - 8
    assert cache.peek(A + [99]) == len(A)  # peek counts both tiers and touches nothing
    hit = fetch(cache, A + [99])
    assert hit.source is HitSource.DISK and hit.matched == len(A) and hit.disk_tokens == len(A)
    hit = fetch(cache, A + [99])
    assert hit.source is HitSource.RADIX and hit.disk_tokens == 0  # resident again
    stats = cache.stats()
    assert stats.disk_hits == 1 and stats.disk_hit_tokens == len(A) and stats.spilled_blocks == 6
    assert cache.disk is not None
    cache.disk.close()


def test_an_exact_entry_outlives_its_blocks_spilling_to_disk(tmp_path: Path) -> None:
    cache = make_tiered_cache(tmp_path, num_blocks=8, block_size=BS)
    logits = torch.arange(5.0)
    store(cache, A, logits=logits)
    assert cache.evict(8) == 4 and len(cache.exact) == 0  # its blocks are only on disk now
    hit = fetch(cache, A)  # the same prompt again: exact, the path loaded back
    assert hit.source is HitSource.EXACT and hit.matched == len(A)
    assert hit.logits is not None and torch.equal(hit.logits, logits)
    assert len(cache.exact) == 1 and not cache.exact.saved()
    # saved while parked, its logits go beside the index like a live entry's
    cache.evict(8)
    assert list(exact_logits(cache).values())[0] is logits
    assert cache.disk is not None
    cache.disk.close()


def test_a_pool_full_of_other_prompts_makes_room_for_a_disk_hit(tmp_path: Path) -> None:
    cache = make_tiered_cache(tmp_path, num_blocks=4, block_size=BS)
    store(cache, A)  # 4 blocks: the whole pool
    store(cache, B)  # spills A's tail to make room
    hit = fetch(cache, A + [99])
    assert hit.matched == len(A) and hit.source is HitSource.DISK
    assert fetch(cache, B).matched == len(B) - 1
    assert cache.disk is not None
    cache.disk.close()


def test_a_disk_prefix_with_no_room_to_load_is_explained_by_what_was_served(
    tmp_path: Path,
) -> None:
    cache = make_tiered_cache(tmp_path, num_blocks=4, block_size=BS)
    store(cache, A)
    assert cache.evict(4) == 4  # A is only on disk now
    running = store(cache, list(range(70, 86)), hold=True)  # a request holds every block
    hit = cache.lookup(A + [99])
    assert (hit.matched, hit.source) == (0, HitSource.MISS)
    assert hit.why is not None
    assert (hit.why.reason, hit.why.cached, hit.why.disk_through) == (
        MissReason.POOL_FULL, 0, len(A))
    line = hit.why.describe(A + [99], None, Visibility.CACHE)
    assert line.startswith(f"pool full: tokens 0-{len(A)} of 15")
    assert hit.why.to_json()["disk_through"] == len(A)
    cache.release(hit.blocks)
    cache.release(running.blocks)
    again = fetch(cache, A + [99])  # room again: the same prefix is a disk hit, and says so
    assert again.source is HitSource.DISK and again.matched == len(A)
    assert again.why is not None and again.why.reason is MissReason.HIT
    assert cache.disk is not None
    cache.disk.close()


def test_a_restart_rebuilds_the_tree_without_reading_a_block(tmp_path: Path) -> None:
    cache = make_tiered_cache(tmp_path, num_blocks=8, block_size=BS)
    store(cache, A)
    meta = json.loads(json.dumps(export_index(cache)))
    assert cache.disk is not None
    cache.disk.close()
    fresh = make_tiered_cache(tmp_path, num_blocks=8, block_size=BS)
    import_index(fresh, meta)
    fresh.check_integrity()
    assert fresh.manager.num_free == 8 and fresh.peek(A) == len(A)
    # the restarted tree's branch shows its blocks as on disk, not as "0 blk"
    (node,) = cv.nodes_from_cache(fresh)
    assert node.blocks == 0 and node.disk_blocks == -(-len(A) // BS)
    assert f"{node.disk_blocks} blk on disk" in views.node_label(node, None).plain
    assert cv.tree_json([node])[0]["disk_blocks"] == node.disk_blocks
    hit = fetch(fresh, A + [5])
    assert hit.source is HitSource.DISK and hit.matched == len(A)
    assert fresh.disk is not None
    fresh.disk.close()


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_a_damaged_block_file_is_never_served(tmp_path: Path, damage: str) -> None:
    cache = make_tiered_cache(tmp_path, num_blocks=8, block_size=BS)
    store(cache, A)
    cache.evict(8)
    assert cache.disk is not None
    cache.disk.flush()
    second = cache.tree.find_prefix(A).disk[1].key
    path = block_path(tmp_path, second)
    data = bytearray(path.read_bytes())
    if damage == "corrupt":
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:100]))
    else:
        path.unlink()
    hit = fetch(cache, A + [99])
    assert hit.matched == BS  # the first block only: the damaged one and all after it went
    assert cache.peek(A) == BS
    notices = cache.take_notices()
    if damage != "delete":
        assert any(second[:12] in n for n in notices)
    assert cache.stats().disk_failures == 1
    store(cache, A)  # recomputed and cached again, correctly
    assert fetch(cache, A + [99]).matched == len(A)
    cache.disk.close()


def test_the_disk_budget_is_respected(tmp_path: Path) -> None:
    probe = make_tiered_cache(tmp_path / "probe", num_blocks=4, block_size=BS)
    assert probe.disk is not None
    per_block = probe.disk.layout.payload_bytes
    probe.disk.close()
    cache = make_tiered_cache(tmp_path / "s", num_blocks=4, block_size=BS,
                              budget_bytes=3 * (per_block + 1024))
    for start in range(0, 80, 16):
        store(cache, list(range(start + 100, start + 116)))
    assert cache.disk is not None
    cache.disk.flush()
    stats = cache.disk.stats()
    assert stats.bytes <= stats.budget_bytes and stats.evictions > 0
    export_index(cache)  # prunes blocks whose files the budget removed
    cache.check_integrity()
    for node, _ in cache.tree.nodes():
        for key in node.keys[len(node.blocks):]:
            assert cache.disk.exists(key)
    cache.disk.close()


def test_a_save_with_a_budget_smaller_than_the_cache_is_no_failure(tmp_path: Path) -> None:
    """Resident blocks the store wrote, then deleted to stay within its budget, leave the tree
    at the save (tombstones say "disk budget"); only a write that failed fails a save."""
    probe = make_tiered_cache(tmp_path / "probe", num_blocks=4, block_size=BS)
    assert probe.disk is not None
    per_block = probe.disk.layout.payload_bytes
    probe.disk.close()
    cache = make_tiered_cache(tmp_path / "s", num_blocks=16, block_size=BS,
                              budget_bytes=int(2.5 * (per_block + 1024)))
    for start in (100, 200):
        store(cache, list(range(start, start + 14)))
    cache.persist()  # raised WriteError("... not stored ...") when the budget evicted blocks
    assert cache.disk is not None and cache.disk.stats().write_failures == 0
    cache.check_integrity()
    for node, _ in cache.tree.nodes():
        for key in node.keys[len(node.blocks):]:
            assert cache.disk.exists(key)
    cache.disk.close()


def test_clear_forgets_both_tiers(tmp_path: Path) -> None:
    cache = make_tiered_cache(tmp_path, num_blocks=8, block_size=BS)
    store(cache, A)
    cache.evict(2)
    cache.clear()
    cache.check_integrity()
    assert cache.peek(A) == 0 and list(cache.tree.nodes()) == []
    assert cache.disk is not None
    cache.disk.close()


# ---- through the engine and the runtime, on the tiny model ---------------------------------

ATOL = 1e-4


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 250) for _ in range(n)]


def run(engine: Engine, ids: list[int], max_new: int = 6) -> GenerationResult:
    return engine.generate(Request(ids, SamplingParams(max_new_tokens=max_new),
                                   record_logits=True))


def assert_same(cold: GenerationResult, warm: GenerationResult) -> None:
    c = compare(cold, warm)
    assert c.equal, f"tokens diverge at {c.first}: {cold.token_ids} vs {warm.token_ids}"
    assert c.diff <= ATOL, f"max |logit diff| {c.diff}"


def tiered_runtime(model: Any, tokenizer: Any, root: Path, num_blocks: int = 24,
                   policy: str = "lru") -> Runtime:
    return make_runtime(model, tokenizer, root, block_size=BS, num_blocks=num_blocks,
                        policy=policy)


@pytest.mark.parametrize("policy", ["lru", "sink-lru", "h2o"])
def test_cached_equals_cold_with_hits_from_disk_after_a_restart(tiny_model, tiny_tokenizer,
                                                                tmp_path, policy):
    a = tiered_runtime(tiny_model, tiny_tokenizer, tmp_path, policy=policy)
    prompts = [prompt(i, 30 + 3 * i) for i in range(3)]
    for p in prompts:
        run(a.engine, p)
    a.cache.evict(a.cache.manager.num_blocks)  # all to disk (sink-lru and h2o keep first blocks)
    assert a.cache.manager.num_free >= a.cache.manager.num_blocks - len(prompts)
    a.save()
    a.close()
    b = tiered_runtime(tiny_model, tiny_tokenizer, tmp_path, policy=policy)
    assert b.restored_tokens > 0 and b.cache.manager.num_free == b.cache.manager.num_blocks
    cold_engine = b.engine.without_cache()
    for p in prompts:
        longer = p + [5, 6, 7]
        warm = run(b.engine, longer)
        assert warm.hit_source == "disk" and warm.cache_hit_tokens == len(p)
        assert warm.disk_hit_tokens >= len(p) - BS
        assert_same(run(cold_engine, longer), warm)
        b.cache.check_integrity()
    fields = result_fields(warm)
    assert fields["disk_hit_tokens"] == warm.disk_hit_tokens
    assert b.cache.stats().disk_hit_tokens >= sum(len(p) - BS for p in prompts)
    assert b.cache.stats().disk_hits == len(prompts)
    b.close()


def test_rows_never_claim_a_hit_their_counters_deny(tiny_model, tiny_tokenizer, tmp_path):
    """A warm rerun through a pool too small for every prompt's K/V at once: requests admitted
    together hold the pool, so disk prefixes cannot all be loaded; each explanation says what
    its own lookup served."""
    rt = tiered_runtime(tiny_model, tiny_tokenizer, tmp_path, num_blocks=40)
    rt.engine.batch_size = 8
    prompts = [prompt(20 + i, 60) for i in range(8)]
    results: list[GenerationResult] = []
    for _ in range(2):
        handles = [rt.engine.submit(Request(p, SamplingParams(max_new_tokens=4))) for p in prompts]
        results += [h.run() for h in handles]
        rt.cache.check_integrity()
    assert any(r.miss_reason == "pool_full" for r in results[8:])  # the case happened
    for r in results:
        full = r.cache_hit_tokens >= r.prompt_tokens - 1
        assert (r.miss_reason == "hit") == full, (r.miss_reason, r.cache_hit_tokens, r.miss_detail)
        if r.miss_reason in ("diverged", "pool_full"):
            assert f"tokens {r.cache_hit_tokens}-" in r.miss_detail or (
                f"token {r.cache_hit_tokens} " in r.miss_detail)
    rt.close()


def test_a_corrupt_block_is_recomputed_correctly(tiny_model, tiny_tokenizer, tmp_path):
    a = tiered_runtime(tiny_model, tiny_tokenizer, tmp_path)
    p = prompt(7, 40)
    run(a.engine, p)
    a.save()
    a.close()
    store_dir = tmp_path / "cache" / "store"
    files = sorted((store_dir / "blocks").rglob("*.kvb"))
    assert files
    for f in files:  # every block damaged: nothing may be served
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    b = tiered_runtime(tiny_model, tiny_tokenizer, tmp_path)
    warm = run(b.engine, p + [9])
    assert warm.hit_source == "miss" and warm.disk_hit_tokens == 0
    assert_same(run(b.engine.without_cache(), p + [9]), warm)
    assert any("not used" in n for n in b.take_notices())
    b.cache.check_integrity()
    b.close()


def test_saving_writes_only_the_new_blocks(tiny_model, tiny_tokenizer, tmp_path):
    rt = tiered_runtime(tiny_model, tiny_tokenizer, tmp_path, num_blocks=64)
    history = prompt(3, 40)
    run(rt.engine, history)
    rt.save()
    assert rt.disk is not None
    before = rt.disk.stats().writes
    run(rt.engine, history + [1, 2, 3, 4, 5, 6, 7, 8])
    rt.save()
    new = rt.disk.stats().writes - before
    assert 0 < new <= 6  # the turn's blocks (and the grown partial one), not the whole history
    rt.close()


def test_inspect_reports_both_tiers_without_torch(tiny_model, tiny_tokenizer, tmp_path):
    from typer.testing import CliRunner

    from kvchat import cli

    rt = tiered_runtime(tiny_model, tiny_tokenizer, tmp_path)
    run(rt.engine, prompt(4, 50))
    rt.cache.evict(4)
    rt.save()
    rt.close()
    out = CliRunner().invoke(cli.app, ["inspect", "--sessions-dir", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    tiers = json.loads(out.output)["tiers"]
    assert tiers["disk"]["blocks"] >= 4 and tiers["disk"]["bytes"] > 0
    assert tiers["disk"]["budget_bytes"] == 10 << 30 and 0 < tiers["disk"]["tokens"] <= 4 * BS
    assert tiers["memory"]["blocks"] > 0
    text = CliRunner().invoke(cli.app, ["inspect", "--sessions-dir", str(tmp_path)]).output
    flat = " ".join(text.replace("│", " ").split())
    assert f"disk tier {tiers['disk']['blocks']} blocks" in flat  # beside the pool's numbers
    assert f"{tiers['disk']['tokens']} tok only on disk" in flat
    assert f"· {tiers['disk']['tokens']} on disk" in flat  # the pool panel's cached line


CHILD = """
import sys, time
from pathlib import Path
from kvchat.config import CacheConfig, SamplingParams
from kvchat.engine.sequence import Request
from kvchat.runtime import Runtime, RuntimeOptions
from kvchat.inspect import documents as cv
from kvchat.ui import views
root, model = Path(sys.argv[1]), sys.argv[2]
cfg = CacheConfig(4, num_blocks=16)
rt = Runtime.open(RuntimeOptions(model=model, device="cpu", cache=cfg, sessions_dir=root))
for i in range(1000):
    ids = [(i * 7 + j) % 250 for j in range(40)]
    rt.engine.generate(Request(ids, SamplingParams(max_new_tokens=2)))
    if i % 3 == 0:
        rt.save()
    print("turn", i, flush=True)
"""


def test_a_sigkill_during_write_behind_leaves_a_consistent_cache(tiny_model_dir, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(tiny_model_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    turns = 0
    for line in proc.stdout:  # kill it mid-run, saves and spills in flight
        turns += line.startswith("turn")
        if turns >= 8:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert turns >= 8, "the child did not run"
    rt = Runtime.open(RuntimeOptions(model=str(tiny_model_dir), device="cpu",
                                     cache=CacheConfig(BS, num_blocks=16), sessions_dir=tmp_path))
    rt.cache.check_integrity()
    assert rt.restored_tokens > 0, (rt.notice, sorted(p.name for p in tmp_path.rglob("*")))
    cold = rt.engine.without_cache()
    for i in range(8):
        ids = [(i * 7 + j) % 250 for j in range(40)] + [3]
        warm = run(rt.engine, ids)
        assert_same(run(cold, ids), warm)
        rt.cache.check_integrity()
    assert rt.cache.stats().disk_hit_tokens > 0
    rt.close()


def test_two_processes_writing_the_same_blocks(tmp_path: Path) -> None:
    first = make_tiered_cache(tmp_path, num_blocks=8, block_size=BS)
    second = make_tiered_cache(tmp_path, num_blocks=8, block_size=BS)
    for cache in (first, second):
        store(cache, A)
        cache.evict(8)
    for cache in (first, second):
        assert cache.disk is not None
        cache.disk.flush()
    hit = fetch(second, A + [1])
    assert hit.source is HitSource.DISK and hit.matched == len(A)
    for cache in (first, second):
        assert cache.disk is not None
        cache.disk.close()
    assert not list(tmp_path.rglob("*.tmp"))


def test_the_hit_panel_shows_memory_and_disk_tokens() -> None:
    from rich.console import Console

    from kvchat.ui.views import TurnView, hit_panel

    turn = TurnView(3, 100, 80, "disk", 20.0, 15.0, 4, 50.0, "stop", None, disk_hit_tokens=60)
    console = Console(width=80, record=True, color_system=None)
    console.print(hit_panel(turn))
    assert "memory 20 tok · disk 60 tok" in console.export_text()


def test_bench_tiers_measures_every_figure_on_the_tiny_model(tiny_model, tiny_tokenizer):
    from rich.console import Console

    from kvchat.bench.tiers import bench_tiers
    from kvchat.ui.bench_view import tiers_table

    res = bench_tiers(tiny_model, tiny_tokenizer, small=1024, large=3072, prompt_tokens=128,
                      pool_tokens=128, trials=1)
    assert res.hit_rate_tier > res.hit_rate_no_tier  # prefixes reloaded from disk
    assert min(res.save_ratio, res.open_ratio, res.disk_vs_memory, res.cold_vs_disk) > 0
    console = Console(width=160, record=True, color_system=None)
    console.print(tiers_table(res))
    text = console.export_text()
    assert "save after one turn" in text and "token hit rate" in text
    assert json.loads(json.dumps(res.to_json()))["save_ratio"] == res.save_ratio
