"""GET /metrics over real HTTP on the tiny model: the Prometheus text format, with vLLM-like
names whose values follow what the requests did, behind the token; a tenant sees its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvchat.config import CacheConfig
from kvchat.runtime import Runtime, RuntimeOptions
from kvchat.server import Auth, create_app, serving

ADMIN, KEY = "admin-token", "tenant-key"
SYSTEM = "You are a careful assistant who answers every question in one short sentence."


@pytest.fixture
def url(tiny_model_dir: Path, tmp_path: Path) -> Iterator[str]:
    runtime = Runtime.open(RuntimeOptions(model=str(tiny_model_dir), device="cpu",
                                          sessions_dir=tmp_path / "sessions",
                                          cache=CacheConfig(4, num_blocks=4000)))
    app = create_app(runtime, batch_size=4, max_tokens=4, auth=Auth(ADMIN, (KEY,)))
    with serving(app) as (base, _):
        yield base


def scrape(url: str, token: str) -> dict[str, float]:
    reply = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"})
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain")
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items()))
            values[key] = sample.value
    return values


def ask(url: str, token: str, question: str) -> dict[str, int]:
    body = {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}], "max_tokens": 3}
    reply = httpx.post(f"{url}/generate", json=body, headers={"Authorization": f"Bearer {token}"},
                       timeout=60)
    assert reply.status_code == 200
    result: dict[str, int] = reply.json()
    return result


def test_metrics_follow_the_requests_and_need_the_token(url: str) -> None:
    assert httpx.get(f"{url}/metrics").status_code == 401
    before = scrape(url, ADMIN)
    assert before["kvchat:prefix_cache_queries_total"] == 0
    assert before["kvchat:time_to_first_token_seconds_count"] == 0
    assert before["kvchat:num_requests_running"] == 0
    assert before["kvchat:num_requests_waiting"] == 0
    first = ask(url, ADMIN, "What is the sea?")
    second = ask(url, ADMIN, "What is a river?")  # shares the system prompt
    after = scrape(url, ADMIN)
    assert after["kvchat:prefix_cache_queries_total"] == \
        first["prompt_tokens"] + second["prompt_tokens"]
    assert after["kvchat:prefix_cache_hits_total"] == second["cache_hit_tokens"] > 0
    assert after["kvchat:time_to_first_token_seconds_count"] == 2
    assert after["kvchat:time_to_first_token_seconds_bucket{le=+Inf}"] == 2
    assert 0 < after["kvchat:kv_cache_usage_perc"] <= 1
    assert after["kvchat:prefix_cache_evictions_total"] == 0
    assert after["kvchat:requests_total"] == 2
    assert after["kvchat:request_outcomes_total{outcome=completed}"] == 2


def test_a_tenant_sees_only_its_own_requests(url: str) -> None:
    ask(url, ADMIN, "What is the sea?")
    mine = ask(url, KEY, "What is a lake?")
    own = scrape(url, KEY)
    assert own["kvchat:prefix_cache_queries_total"] == mine["prompt_tokens"]
    assert own["kvchat:requests_total"] == 1
    assert "kvchat:kv_cache_usage_perc" not in own  # the pool's occupancy shows others' prompts
    assert "kvchat:num_requests_running" not in own
    assert scrape(url, ADMIN)["kvchat:requests_total"] == 2
