"""GET /metrics: the server in the Prometheus text format, with vLLM's names where vLLM has
one (prefix-cache queries and hits in tokens, KV usage, requests running and waiting, time to
first token), so dashboards made for vLLM read kvchat too.

Authenticated like every endpoint. The admin sees the whole server; a tenant sees the counters
of its own requests only (the pool's occupancy and the queue show others' traffic).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from kvchat.server import vllm_names
from kvchat.server.auth import Caller, Tenant
from kvchat.server.state import State
from kvchat.server.worker import EngineWorker, TenantCounters

router = APIRouter()


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def admin_metrics(stats: dict[str, Any], worker: EngineWorker) -> Iterator[Metric]:
    """The whole server, from a /cache/stats document read on the engine thread."""
    server = stats.get("server", {})
    yield _counter("kvchat:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                   "cache.", stats.get("lookup_tokens", 0))
    yield _counter("kvchat:prefix_cache_hits", "Prompt tokens the prefix cache served.",
                   stats.get("hit_tokens", 0))
    yield _counter("kvchat:prefix_cache_evictions", "Blocks evicted from the KV pool.",
                   stats.get("eviction_count", 0))
    yield _gauge("kvchat:kv_cache_usage_perc", "Fraction of the KV pool's blocks in use "
                 "(1 = full).", stats.get("pool", {}).get("utilisation") or 0.0)
    yield _gauge("kvchat:num_requests_running", "Requests in the decode batch.",
                 server.get("running", 0))
    yield _gauge("kvchat:num_requests_waiting", "Requests waiting to be admitted.",
                 server.get("pending", 0))
    yield from _requests(server.get("requests", 0), server.get("completed", 0),
                         server.get("cancelled", 0), server.get("errors", 0))
    yield _counter("kvchat:draft_tokens", "Reply tokens the cache proposed as drafts.",
                   server.get("draft_tokens", 0))
    yield _counter("kvchat:draft_accepted_tokens", "Drafted tokens verification kept.",
                   server.get("draft_accepted", 0))
    yield _counter("kvchat:replayed_tokens", "Reply tokens exact greedy repeats took from a "
                   "stored reply, with no forward.", server.get("replayed_tokens", 0))
    yield from worker.ttft.collect()
    yield from vllm_names.from_stats(stats)


def tenant_metrics(own: TenantCounters) -> Iterator[Metric]:
    """One tenant's own requests, and what the cache did for them."""
    yield _counter("kvchat:prefix_cache_queries", "Prompt tokens of your requests looked up "
                   "in the prefix cache.", own.prompt_tokens)
    yield _counter("kvchat:prefix_cache_hits", "Prompt tokens of your requests the prefix "
                   "cache served.", own.hit_tokens)
    yield from _requests(own.requests, own.completed, own.cancelled, own.errors)
    yield from vllm_names.by_tier(own.prompt_tokens, own.hit_tokens, own.disk_hit_tokens,
                                  own.shared_hit_tokens)


def _requests(requests: int, completed: int, cancelled: int, errors: int) -> Iterator[Metric]:
    yield _counter("kvchat:requests", "Requests admitted to the engine.", requests)
    outcome = CounterMetricFamily("kvchat:request_outcomes", "Requests by how they ended.",
                                  labels=["outcome"])
    for label, value in (("completed", completed), ("cancelled", cancelled),
                         ("error", errors)):
        outcome.add_metric([label], value)
    yield outcome


class _Snapshot:
    """A collector over metrics already read, for one exposition."""

    def __init__(self, metrics: Iterable[Metric]) -> None:
        self.metrics = list(metrics)

    def collect(self) -> Iterable[Metric]:
        return self.metrics


def exposition(metrics: Iterable[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(vllm_names.with_vllm_names(metrics)))
    return bytes(generate_latest(registry))


@router.get("/metrics", response_model=None)
async def metrics(state: State, tenant: Caller) -> Response:
    """The Prometheus text format (scrape with `Authorization: Bearer TOKEN`)."""
    worker = state.worker
    if tenant.admin:
        body = exposition(admin_metrics(await state.on_engine(worker.stats), worker))
    else:
        body = exposition(tenant_metrics(await _own(state, tenant)))
    return Response(body, media_type=CONTENT_TYPE_LATEST)


async def _own(state: Any, tenant: Tenant) -> TenantCounters:
    worker = state.worker
    counters: dict[str, TenantCounters] = await state.on_engine(
        lambda: worker.call(lambda: dict(worker.tenants)))
    return counters.get(tenant.id, TenantCounters())
