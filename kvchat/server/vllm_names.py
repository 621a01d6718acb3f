"""vLLM's metric names beside kvchat's own, for the dashboards and routers made for vLLM, and the
prefix cache's hits by tier, as SGLang's `cached_tokens_total{cache_source=...}` splits them.

    kvchat:prefix_cache_queries   -> vllm:prefix_cache_queries     (prompt tokens looked up)
    kvchat:prefix_cache_hits      -> vllm:prefix_cache_hits        (tokens served, every tier)
    kvchat:kv_cache_usage_perc    -> vllm:kv_cache_usage_perc
    kvchat:num_requests_running   -> vllm:num_requests_running
    kvchat:num_requests_waiting   -> vllm:num_requests_waiting
    kvchat:time_to_first_token_seconds -> vllm:time_to_first_token_seconds
    shared-tier hits              -> vllm:external_prefix_cache_queries / _hits (vLLM's names
                                     for hits from a KV connector such as LMCache)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

ALIASED = ("prefix_cache_queries", "prefix_cache_hits", "kv_cache_usage_perc",
           "num_requests_running", "num_requests_waiting", "time_to_first_token_seconds")


def by_tier(lookup_tokens: int, hit_tokens: int, disk: int, shared: int) -> Iterator[Metric]:
    """Hit tokens by the tier that served them, and the shared tier in vLLM's words."""
    family = CounterMetricFamily("kvchat:cached_tokens", "Prompt tokens the cache served, by "
                                 "tier: memory (the pool), disk (blocks this instance stored), "
                                 "shared (blocks other instances put in a shared store).",
                                 labels=["cache_source"])
    for source, value in (("memory", hit_tokens - disk - shared), ("disk", disk),
                          ("shared", shared)):
        family.add_metric([source], value)
    yield family
    yield CounterMetricFamily("vllm:external_prefix_cache_queries", "Prompt tokens looked up "
                              "(the shared tier is asked after the local ones).",
                              value=lookup_tokens)
    yield CounterMetricFamily("vllm:external_prefix_cache_hits", "Prompt tokens served from "
                              "blocks other instances put in a shared store.", value=shared)


def from_stats(stats: dict[str, Any]) -> Iterator[Metric]:
    yield from by_tier(stats.get("lookup_tokens", 0), stats.get("hit_tokens", 0),
                       stats.get("disk_hit_tokens", 0), stats.get("shared_hit_tokens", 0))


def with_vllm_names(metrics: Iterable[Metric]) -> Iterator[Metric]:
    """Every metric, and after each of those vLLM also has a copy under vLLM's name."""
    for metric in metrics:
        yield metric
        name = metric.name.removeprefix("kvchat:")
        if metric.name.startswith("kvchat:") and name in ALIASED:
            alias = Metric(f"vllm:{name}", metric.documentation, metric.type, metric.unit)
            alias.samples = [s._replace(name=s.name.replace("kvchat:", "vllm:", 1))
                             for s in metric.samples]
            yield alias
