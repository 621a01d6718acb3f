"""kvchat serve as a router's worker, over real HTTP on the tiny model: what sglang-router and
vllm-router probe without credentials, vLLM's metric names beside kvchat's, hits split by tier,
and the affinity header naming a routed session's counters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_metrics import ADMIN, KEY, SYSTEM, scrape

from kvchat.config import CacheConfig
from kvchat.runtime import Runtime, RuntimeOptions
from kvchat.server import Auth, create_app, serving


@pytest.fixture
def url(tiny_model_dir: Path, tmp_path: Path) -> Iterator[str]:
    runtime = Runtime.open(RuntimeOptions(model=str(tiny_model_dir), device="cpu",
                                          sessions_dir=tmp_path / "sessions",
                                          cache=CacheConfig(4, num_blocks=4000)))
    app = create_app(runtime, batch_size=4, max_tokens=4, auth=Auth(ADMIN, (KEY,)))
    with serving(app) as (base, _):
        yield base


def chat(url: str, token: str, user: str, **headers: str) -> dict:  # type: ignore[type-arg]
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       headers={"Authorization": f"Bearer {token}", **headers},
                       json={"messages": [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": user}],
                             "max_tokens": 2, "temperature": 0,
                             # what sglang-router adds to every body it forwards
                             "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
                             "skip_special_tokens": True, "separate_reasoning": True,
                             "return_hidden_states": False})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_what_routers_probe_is_open_and_names_no_path(url: str, tiny_model_dir: Path) -> None:
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(f"{url}{path}").json()
        assert info["served_model_name"] == tiny_model_dir.name and info["dp_size"] == 1
        assert str(tiny_model_dir) not in str(info)
    assert httpx.get(f"{url}/model_info").json() == {"model_path": tiny_model_dir.name,
                                                      "is_generation": True}
    load = httpx.get(f"{url}/get_load").json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert httpx.get(f"{url}/cache/stats").status_code == 401  # the rest stays closed
    chat(url, ADMIN, "Hello there.")
    assert httpx.get(f"{url}/get_load").json()[0]["num_tokens"] > 0


def test_vllm_names_and_hits_by_tier_beside_kvchats_own(url: str) -> None:
    first = chat(url, ADMIN, "What is a cache?")
    second = chat(url, ADMIN, "What is a page?")
    hit = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert hit > 0
    values = scrape(url, ADMIN)
    prompt = first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"]
    for prefix in ("kvchat", "vllm"):
        assert values[f"{prefix}:prefix_cache_queries_total"] == prompt
        assert values[f"{prefix}:prefix_cache_hits_total"] == hit
        assert values[f"{prefix}:num_requests_running"] == 0
        assert f"{prefix}:kv_cache_usage_perc" in values
        assert values[f"{prefix}:time_to_first_token_seconds_count"] == 2
    assert values["kvchat:cached_tokens_total{cache_source=memory}"] == hit
    assert values["kvchat:cached_tokens_total{cache_source=disk}"] == 0
    assert values["kvchat:cached_tokens_total{cache_source=shared}"] == 0
    assert values["vllm:external_prefix_cache_hits_total"] == 0
    own = scrape(url, KEY)  # a tenant: its own counters, by tier too
    assert own["vllm:prefix_cache_queries_total"] == 0
    assert own["kvchat:cached_tokens_total{cache_source=memory}"] == 0


def test_the_affinity_header_names_the_routed_sessions_counters(url: str) -> None:
    chat(url, ADMIN, "One.", **{"x-session-id": "alice"})
    chat(url, ADMIN, "Two.", **{"X-SMG-Routing-Key": "bob"})
    chat(url, KEY, "Three.", **{"x-session-id": "carol"})
    chat(url, ADMIN, "Four.", **{"x-session-id": "not a name!"})  # ignored, not refused
    stats = httpx.get(f"{url}/cache/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert stats["sessions"]["alice"]["lookups"] == 1 and stats["sessions"]["bob"]["lookups"] == 1
    assert "not a name!" not in stats["sessions"]
    tenant = httpx.get(f"{url}/cache/stats", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert list(tenant["sessions"]) == ["carol"]


def test_generate_takes_what_vllm_router_adds_while_it_asks_for_nothing(url: str) -> None:
    auth = {"Authorization": f"Bearer {ADMIN}"}
    body = {"prompt": "Hi?", "stream": False, "return_logprob": False,
            "return_hidden_states": False}
    assert httpx.post(f"{url}/generate", json=body, headers=auth, timeout=60).status_code == 200
    refused = httpx.post(f"{url}/generate", json={**body, "return_logprob": True},
                         headers=auth, timeout=60)
    assert refused.status_code == 400
