"""A fleet on loopback: two `kvchat serve` instances (tiny model) sharing one block store (a real
redis-server) behind a real sglang-router (cache_aware), and a vllm-router smoke test on a
shared folder. Needs the routers (`pip install
'kvchat[fleet]'`); skipped where they are absent unless $KVCHAT_REQUIRE_FLEET is set (CI)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _fleet_helpers import (
    KEYS,
    TOKEN,
    get_json,
    redis_server,
    router,
    start_instance,
    stop,
    wait_until,
)

SYSTEMS = [f"You are assistant number {g}. " + "Answer in one careful sentence. " * 6
           for g in range(3)]


def ask(url: str, system: str, user: str, key: str = KEYS[0], max_tokens: int = 2,
        headers: dict[str, str] | None = None) -> dict[str, Any]:
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                       headers={"Authorization": f"Bearer {key}", **(headers or {})},
                       json={"messages": [{"role": "system", "content": system},
                                          {"role": "user", "content": user}],
                             "max_tokens": max_tokens, "temperature": 0})
    reply.raise_for_status()
    return reply.json()


def cached(reply: dict[str, Any]) -> int:
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def stats(url: str) -> dict[str, Any]:
    return get_json(f"{url}/cache/stats", TOKEN)


@pytest.fixture
def fleet(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[list[str], list[Any]]]:
    """Two instances on one redis-server the test starts (the vllm-router test below shares a
    folder instead)."""
    with redis_server(tmp_path) as (store, _):
        started = [start_instance(tiny_model_dir, tmp_path, name, store) for name in ("a", "b")]
        try:
            yield [u for u, _ in started], [p for _, p in started]
        finally:
            for _, proc in started:
                stop(proc)


def test_a_fleet_behind_sglang_router(fleet: tuple[list[str], list[Any]], tmp_path: Path) -> None:
    (a, b), procs = fleet
    # (b) a prefix computed on instance A is a shared-tier hit on instance B
    first = ask(a, SYSTEMS[0], "Where is Lisbon?")
    assert cached(first) == 0
    on_b = ask(b, SYSTEMS[0], "Where is Porto?")
    shared = stats(b)
    assert shared["shared_hit_tokens"] >= cached(on_b) - 8 > 0
    assert shared["shared_hits"] == 1
    assert cached(ask(b, SYSTEMS[0], "Where is Lisbon?", key=KEYS[1])) == 0  # salted apart
    with router("sglang", [a, b], "cache_aware", tmp_path) as (url, _):
        # (a) a group's later requests hit, on whichever instance serves them
        for g in (1, 2):
            replies = [ask(url, SYSTEMS[g], f"Question {i} of group {g}?") for i in range(4)]
            prefix = min(cached(r) for r in replies[1:])
            assert prefix >= len(SYSTEMS[g]) // 2, [cached(r) for r in replies]
        served = [stats(u)["lookup_tokens"] for u in (a, b)]
        assert all(served)  # the warm-up and the groups reached both instances
        # (c) killing one instance fails only its in-flight requests
        b_before = get_json(f"{b}/cache/stats", TOKEN)["server"]
        with cf.ThreadPoolExecutor(8) as pool:
            # new prefixes: cache_aware spreads them by the size of its trees
            jobs = [pool.submit(ask, url, f"{i} is your number. " * 5, "Go on?", KEYS[0], 64)
                    for i in range(8)]
            with contextlib.suppress(AssertionError):  # kill A while it decodes, if it does
                wait_until(lambda: get_json(f"{a}/get_load")[0]["num_reqs"] > 0, 10, "work")
            procs[0].send_signal(signal.SIGKILL)
            outcomes = [job.exception(timeout=180) for job in jobs]
        b_after = get_json(f"{b}/cache/stats", TOKEN)["server"]
        admitted_by_b = b_after["requests"] - b_before["requests"]
        failed = sum(e is not None for e in outcomes)
        assert b_after["errors"] == b_before["errors"]  # nothing failed on the survivor
        assert failed <= 8 - min(admitted_by_b, 8)
        after = [ask(url, SYSTEMS[i % 3], f"After the kill {i}?") for i in range(4)]
        assert all(r["choices"][0]["message"]["content"] is not None for r in after)
        assert stats(b)["server"]["completed"] >= b_before["completed"] + 4


def test_a_request_through_vllm_router(tiny_model_dir: Path, tmp_path: Path) -> None:
    workers = [start_instance(tiny_model_dir, tmp_path, name, str(tmp_path / "store"),
                              "--shared-store") for name in ("a", "b")]
    try:
        urls = [u for u, _ in workers]
        with router("vllm", urls, "consistent_hash", tmp_path) as (url, _):
            one = ask(url, SYSTEMS[0], "Hello?", headers={"x-session-id": "s-1"})
            two = ask(url, SYSTEMS[0], "Hello again?", headers={"x-session-id": "s-1"})
            assert one["object"] == "chat.completion" and cached(two) > 0
            native = httpx.post(f"{url}/generate", json={"prompt": "Hi?"}, timeout=60,
                                headers={"Authorization": f"Bearer {TOKEN}"})
            assert native.status_code == 200, native.text
            assert 1 <= native.json()["completion_tokens"] <= 4
            models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
            assert models.json()["data"][0]["id"] == tiny_model_dir.name
            seen = [stats(u)["sessions"] for u in urls]
            # the session's turns stayed on one instance (under the tenant's session name)
            holders = [s for s in seen if any(k.endswith("/s-1") for k in s)]
            assert len(holders) == 1
            assert sum(v["lookups"] for k, v in holders[0].items() if k.endswith("/s-1")) == 2
    finally:
        for _, proc in workers:
            stop(proc)


def test_no_request_fails_when_the_shared_store_dies(tiny_model_dir: Path,
                                                     tmp_path: Path) -> None:
    with redis_server(tmp_path) as (store, redis):
        url, proc = start_instance(tiny_model_dir, tmp_path, "a", store)
        try:
            assert cached(ask(url, SYSTEMS[0], "First?")) == 0
            stop(redis, signal.SIGKILL)
            replies = [ask(url, SYSTEMS[g % 3], f"Still here {g}?") for g in range(6)]
            assert cached(replies[0]) > 0  # the memory tier goes on serving
        finally:
            stop(proc)
    log = (tmp_path / "a.log").read_text()
    assert log.count("not answering") == 1, log
