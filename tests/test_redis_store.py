"""The block tier on a real redis-server the test starts: blocks by chained key, verified on every
read, Redis's maxmemory as the budget, and a store that is down or slow never failing a lookup."""

from __future__ import annotations

from pathlib import Path

import redis
from _cache_helpers import fetch, make_cache, ref_kv, store
from _fleet_helpers import free_port, redis_server, wait_until
from test_block_store import LAYOUT, assert_same, chain, make_kv

from kvchat.cache.block_backend import ReadStatus
from kvchat.cache.block_file import BlockLayout
from kvchat.cache.block_keys import chain_keys, root_key
from kvchat.cache.kvcache import PagedKVCache
from kvchat.cache.lookup import HitSource
from kvchat.cache.redis_store import PREFIX, RedisStore, public_url

BIG = BlockLayout(n_layers=2, n_kv_heads=2, head_dim=64, block_size=16, dtype="float32")  # 32 KiB


def big_chain(n: int) -> list[tuple[str, list[int]]]:
    tokens = list(range(1000, 1000 + n * BIG.block_size))
    keys = chain_keys(tokens, BIG.block_size, root_key({})).full
    return [(k, tokens[i * BIG.block_size : (i + 1) * BIG.block_size]) for i, k in enumerate(keys)]


def write(store: RedisStore, blocks: list[tuple[str, list[int]]],
          layout: BlockLayout = LAYOUT) -> None:
    for key, tokens in blocks:
        assert store.put(key, tokens, make_kv(key, layout))
    store.flush()


def test_blocks_round_trip_by_key_and_damage_is_never_served(tmp_path: Path) -> None:
    with redis_server(tmp_path) as (url, _), RedisStore(url, LAYOUT, 1 << 30) as store:
        blocks = chain(5)
        write(store, blocks)
        assert store.stats().writes == 5
        assert store.batch_exists([k for k, _ in blocks] + ["ab" * 32]) == 5
        assert not store.exists("ab" * 32)
        for key, tokens in blocks:
            got = store.get(key)
            assert got.status is ReadStatus.HIT and got.tokens == tuple(tokens)
            assert_same(got.kv, make_kv(key))
        client = redis.Redis.from_url(url)
        key = blocks[2][0]
        data = bytearray(client.get(PREFIX + key))
        data[-40] ^= 0xFF
        client.set(PREFIX + key, bytes(data))
        got = store.get(key)
        assert got.status is ReadStatus.CORRUPT and got.notice and "not used" in got.notice
        assert not client.exists(PREFIX + key)  # deleted, never served again
        client.close()


def test_the_budget_is_redis_maxmemory_under_its_lru_policy(tmp_path: Path) -> None:
    budget = 4 << 20
    with redis_server(tmp_path) as (url, _), RedisStore(url, BIG, budget) as store:
        blocks = big_chain(400)  # 12.5 MiB of blocks into a 4 MiB budget
        for key, tokens in blocks:
            store.put(key, tokens, make_kv(key, BIG))
        store.flush()
        client = redis.Redis.from_url(url)
        config = client.config_get("maxmemory*")
        assert int(config["maxmemory"]) == budget and config["maxmemory-policy"] == "allkeys-lru"
        assert client.info("memory")["used_memory"] <= budget
        assert 0 < client.dbsize() < 400
        # Redis's LRU samples keys and its clock ticks once a second, so which blocks 400 writes
        # in a second evict is not fixed (a command after the last write may evict it too): an
        # evicted one reads as a plain miss, never an error, and a kept one as a hit. Reads do
        # not grow memory, so the kept ones stay while they are read.
        kept = {k for k, _ in blocks if client.exists(PREFIX + k)}
        evicted = [k for k, _ in blocks if k not in kept]
        assert store.get(evicted[0]).status is ReadStatus.MISSING
        assert all(store.get(k).status is ReadStatus.HIT for k in sorted(kept)[:3])
        client.close()


def test_a_limit_the_operator_set_is_kept(tmp_path: Path) -> None:
    with redis_server(tmp_path, extra=("--maxmemory", "8mb", "--maxmemory-policy", "noeviction")
                      ) as (url, _), RedisStore(url, LAYOUT, 1 << 20) as store:
        write(store, chain(1))
        client = redis.Redis.from_url(url)
        assert int(client.config_get("maxmemory")["maxmemory"]) == 8 << 20
        assert any("never evicts" in n for n in store.take_notices())
        client.close()


def test_a_dead_store_is_one_warning_and_coming_back_is_another(tmp_path: Path) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with RedisStore(url, LAYOUT, 1 << 30, retry_s=0.1) as store:
        key, tokens = chain(1)[0]
        assert store.get(key).status is ReadStatus.MISSING
        assert store.batch_exists([key]) == 0
        store.put(key, tokens, make_kv(key))
        store.flush()
        assert store.stats().writes == 0
        notices = store.take_notices()
        assert len(notices) == 1 and "not answering" in notices[0]
        with redis_server(tmp_path, port):
            def written() -> bool:
                store.put(key, tokens, make_kv(key))
                store.flush()
                return store.exists(key)

            wait_until(written, 30, "a write after the store came back")
            assert any("answering again" in n for n in store.take_notices())


def test_a_slow_store_times_out_instead_of_holding_the_lookup(tmp_path: Path) -> None:
    with redis_server(tmp_path) as (url, _), RedisStore(url, LAYOUT, 1 << 30,
                                                          timeout_s=0.1) as store:
        blocks = chain(2)
        write(store, blocks[:1])
        other = redis.Redis.from_url(url)
        other.execute_command("CLIENT", "PAUSE", "3000", "ALL")  # the server stalls 3 s
        got = store.get(blocks[0][0])
        assert got.status is ReadStatus.MISSING
        assert any("not answering" in n for n in store.take_notices())
        other.close()


def test_two_instances_on_one_redis_share_blocks_and_tenants_stay_apart(tmp_path: Path) -> None:
    with redis_server(tmp_path) as (url, _):
        a, b = tiered(url), tiered(url)
        a.write_kv(list(range(1, 15)), ref_kv(list(range(1, 15))), 0, namespace="t1")
        store(a, list(range(1, 15)))
        assert a.disk is not None
        a.disk.flush()
        hit = fetch(b, list(range(1, 15)))
        assert hit.source is HitSource.SHARED and hit.shared_tokens == 12
        assert b.lookup(list(range(1, 15)), namespace="t2").matched == 0
        hit = b.lookup(list(range(1, 15)), namespace="t1")
        assert hit.shared_tokens == 12
        b.release(hit.blocks)
        for cache in (a, b):
            assert cache.disk is not None
            cache.disk.close()


def test_a_cache_on_a_dead_store_goes_on_from_memory() -> None:
    cache = tiered(f"redis://127.0.0.1:{free_port()}/0", num_blocks=8)
    prompt = list(range(1, 15))
    store(cache, prompt)
    assert fetch(cache, prompt + [9]).matched == 14  # memory hits as ever
    cache.evict(8)  # the spill is dropped: the store does not answer
    assert cache.disk is not None
    cache.disk.flush()
    hit = fetch(cache, prompt + [9])  # recomputed, not failed
    assert hit.source is HitSource.MISS
    cache.check_integrity()
    assert sum("not answering" in n for n in cache.take_notices()) == 1
    cache.disk.close()


def tiered(url: str, num_blocks: int = 16) -> PagedKVCache:
    cache = make_cache(num_blocks, 4)
    cache.use_store(RedisStore(url, BlockLayout.of(cache.manager), 1 << 30, retry_s=30),
                    {"model": "test"})
    return cache


def test_messages_never_show_the_password() -> None:
    assert public_url("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert "s3cret" not in public_url("redis://user:s3cret@host/1")
    assert public_url("redis://host:6379/0") == "redis://host:6379/0"
