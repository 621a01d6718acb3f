"""Eviction policies under pressure: replay one workload that is bigger than the pool under
lru / sink-lru / h2o and count what each keeps.

Without a model this is a simulation over token sequences: K/V are dummy tensors (1 layer,
1 head, head_dim 1) and H2O's attention mass is synthetic - a sink-plus-recency profile
(the first block and the most recent blocks of a request receive most attention, as measured
attention maps of decoder LMs show). With a model, every request really runs (one new token)
through the engine, so H2O ranks blocks by the attention mass the model actually paid.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from kvchat.bench.results import PolicyRow
from kvchat.cache.blocks import BlockManager
from kvchat.cache.kvcache import PagedKVCache
from kvchat.config import POLICY_NAMES, CacheConfig, SamplingParams


def policy_workload(
    n_requests: int = 400, seed: int = 0, vocab: int = 30_000
) -> list[list[int]]:
    """Shared system prompts of different popularity, multi-turn sessions that extend their own
    history, and exact repeats - the traffic the cache is for."""
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    systems = [words(rng.randrange(120, 260)) for _ in range(6)]
    weights = [1 / (i + 1) for i in range(len(systems))]  # Zipf-like popularity
    sessions: list[list[int]] = []
    out: list[list[int]] = []
    while len(out) < n_requests:
        r = rng.random()
        if r < 0.35 and sessions:  # a session's next turn
            i = rng.randrange(len(sessions))
            sessions[i] = sessions[i] + words(rng.randrange(20, 60))
            out.append(sessions[i])
        elif r < 0.45 and out:  # an exact repeat of something recent
            out.append(out[-rng.randrange(1, min(20, len(out)) + 1)])
        else:
            sys_prompt = rng.choices(systems, weights)[0]
            seq = sys_prompt + words(rng.randrange(15, 50))
            out.append(seq)
            if rng.random() < 0.3:
                sessions.append(seq)
    return out


def _synthetic_mass(n_blocks: int) -> list[float]:
    """Attention a request pays its blocks: the sink block, then decaying with distance."""
    return [(2.0 if i == 0 else 0.0) + 1.0 / (n_blocks - i) for i in range(n_blocks)]


def simulate(
    workload: list[list[int]], policy: str, pool_blocks: int, block_size: int = 16
) -> PolicyRow:
    mgr = BlockManager(pool_blocks, block_size, n_layers=1, n_kv_heads=1, head_dim=1)
    cache = PagedKVCache(mgr, policy, max_exact_entries=64)
    hits = requests_hit = total = 0
    for seq in workload:
        look = cache.lookup(seq)
        hits += look.matched
        requests_hit += bool(look.matched)
        total += len(seq)
        tail = len(seq) - look.matched
        kv = [(torch.zeros(1, 1, tail, 1), torch.zeros(1, 1, tail, 1))]
        res = cache.write_kv(seq, kv, look.matched, logits=torch.zeros(1))
        if policy == "h2o" and res.blocks:
            cache.record_attention(res.blocks, _synthetic_mass(len(res.blocks)))
        cache.release(look.blocks)
    cache.check_integrity()
    stats = cache.stats()
    return PolicyRow(policy, len(workload), total, hits, requests_hit, stats.eviction_count,
                     "synthetic")


def replay_with_model(
    model: Any, tokenizer: Any, workload: list[list[int]], policy: str, pool_blocks: int,
    block_size: int = 16,
) -> PolicyRow:
    from kvchat.engine.engine import Engine
    from kvchat.engine.sequence import Request

    vocab = len(tokenizer)
    backend = Engine.create(model, tokenizer,
                            CacheConfig(block_size, num_blocks=pool_blocks, policy=policy))
    one = SamplingParams(max_new_tokens=1)
    hits = requests_hit = total = 0
    for seq in workload:
        res = backend.generate(Request([t % vocab for t in seq], one))
        hits += res.cache_hit_tokens
        requests_hit += bool(res.cache_hit_tokens)
        total += res.prompt_tokens
    assert backend.cache is not None
    backend.cache.check_integrity()
    return PolicyRow(policy, len(workload), total, hits, requests_hit,
                     backend.cache.stats().eviction_count, "model")


def bench_policies(
    n_requests: int = 400,
    pool_fraction: float = 0.25,
    block_size: int = 16,
    model: Any = None,
    tokenizer: Any = None,
    progress: Callable[[str], None] | None = None,
) -> list[PolicyRow]:
    """One row per policy. The pool holds `pool_fraction` of the workload's distinct blocks."""
    workload = policy_workload(n_requests)
    distinct = {tuple(seq[: (i + 1) * block_size]) for seq in workload
                for i in range(-(-len(seq) // block_size))}
    pool = max(8, int(len(distinct) * pool_fraction))
    rows = []
    for policy in POLICY_NAMES:
        if progress:
            progress(f"policies: {policy}")
        if model is not None:
            rows.append(replay_with_model(model, tokenizer, workload, policy, pool, block_size))
        else:
            rows.append(simulate(workload, policy, pool, block_size))
    return rows
