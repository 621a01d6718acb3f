"""What the disk tier costs and buys, measured on a real model within one run.

- save: saving after one new turn, with a small and a large cache (the save writes only the
  turn's new blocks plus the tree's index, so the two should be close);
- start-up: opening a runtime over a large saved cache vs an empty one (the index alone is read;
  block files wait for their first hit);
- TTFT of a long prompt whose K/V is loaded from disk, vs a memory hit, vs cold;
- hit rate of requests whose distinct prefixes need 4x the pool, with the tier and without.

Each figure is the median of repeated trials after a warm-up; ratios are taken within the run.
Disk reads may come from the OS page cache: the TTFT from disk is a best case for a warm machine.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvchat.bench.engine import random_prompt
from kvchat.bench.results import Timing, as_json
from kvchat.bench.timing import measure, timed
from kvchat.cache.stats import ratio
from kvchat.config import CacheConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.sequence import Request
from kvchat.runtime import Runtime, RuntimeOptions

BLOCK = 16
CHUNK = 1024  # tokens per filler prompt


@dataclass(frozen=True)
class TiersResult:
    small_tokens: int
    large_tokens: int
    save_small: Timing  # a save after one new turn, small cache
    save_large: Timing
    open_empty: Timing  # engine + runtime + index, no cache saved
    open_large: Timing
    prompt_tokens: int
    ttft_cold: Timing
    ttft_memory: Timing
    ttft_disk: Timing
    pool_tokens: int
    distinct_prefix_tokens: int
    hit_rate_tier: float  # token hit rate with the disk tier
    hit_rate_no_tier: float

    @property
    def save_ratio(self) -> float:
        return self.save_large.median_s / self.save_small.median_s

    @property
    def open_ratio(self) -> float:
        return self.open_large.median_s / self.open_empty.median_s

    @property
    def disk_vs_memory(self) -> float:
        return self.ttft_disk.median_s / self.ttft_memory.median_s

    @property
    def cold_vs_disk(self) -> float:
        return self.ttft_cold.median_s / self.ttft_disk.median_s

    def to_json(self) -> dict[str, Any]:
        out = as_json(self)
        out.update(save_ratio=self.save_ratio, open_ratio=self.open_ratio,
                   disk_vs_memory=self.disk_vs_memory, cold_vs_disk=self.cold_vs_disk)
        return dict(out)


def _runtime(model: Any, tokenizer: Any, root: Path, pool_tokens: int,
             disk_gb: float = 10.0) -> Runtime:
    config = CacheConfig(BLOCK, num_blocks=pool_tokens // BLOCK)
    engine = Engine.create(model, tokenizer, config)
    rt = Runtime(engine, RuntimeOptions(cache=config, sessions_dir=root, disk_cache_gb=disk_gb),
                 "bench")
    rt.restore()
    return rt


def _fill(rt: Runtime, tokens: int) -> list[int]:
    """Cache `tokens` tokens of distinct prompts (zero K/V: what a save costs does not depend
    on the values), then save; returns the last prompt, which later turns extend."""
    cache = rt.cache
    shape = (1, cache.manager.n_kv_heads, CHUNK, cache.manager.head_dim)
    zeros = torch.zeros(shape, dtype=cache.manager.dtype)
    last: list[int] = []
    for i in range(max(1, tokens // CHUNK)):
        last = random_prompt(rt.engine, CHUNK, seed=1000 + i)
        cache.write_kv(last, [(zeros, zeros)] * cache.manager.n_layers, 0)
    rt.save()
    return last


def _save_after_a_turn(model: Any, tokenizer: Any, tokens: int, trials: int) -> Timing:
    with tempfile.TemporaryDirectory() as tmp:
        rt = _runtime(model, tokenizer, Path(tmp), pool_tokens=4 * CHUNK)
        history = _fill(rt, tokens)
        engine = rt.engine

        def turn() -> float:
            nonlocal history
            history = history + random_prompt(engine, 48, seed=len(history))
            res = engine.generate(Request(history, SamplingParams(max_new_tokens=16,
                                                                  ignore_eos=True)))
            history = history + res.token_ids
            return timed(rt.save).seconds

        figure = measure(turn, trials)
        rt.close()
    return figure


def _open(model: Any, tokenizer: Any, tokens: int, trials: int) -> Timing:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if tokens:
            rt = _runtime(model, tokenizer, root, pool_tokens=4 * CHUNK)
            _fill(rt, tokens)
            rt.close()

        def open_once() -> float:
            took = timed(lambda: _runtime(model, tokenizer, root, pool_tokens=4 * CHUNK))
            took.value.close()
            return took.seconds

        return measure(open_once, trials)


def _ttft(model: Any, tokenizer: Any, n: int, trials: int) -> tuple[Timing, Timing, Timing]:
    """TTFT of an n-token prompt (plus one new token): cold, hit in memory, hit from disk."""
    with tempfile.TemporaryDirectory() as tmp:
        rt = _runtime(model, tokenizer, Path(tmp), pool_tokens=2 * n + 4 * BLOCK)
        engine, cache = rt.engine, rt.cache
        prompt = random_prompt(engine, n, seed=7)
        suffix = iter(range(10, 10_000))
        params = SamplingParams(max_new_tokens=1)

        def ttft(e: Engine) -> float:
            return e.generate(Request(prompt + [next(suffix)], params)).ttft_ms / 1e3

        cold = measure(lambda: ttft(engine.without_cache()), trials)
        engine.generate(Request(prompt, params))
        rt.save()  # the prompt's blocks on disk
        memory = measure(lambda: ttft(engine), trials)

        def from_disk() -> float:
            cache.evict(cache.manager.num_blocks)  # files exist: nothing is written again
            assert rt.disk is not None
            rt.disk.flush()
            return ttft(engine)

        disk = measure(from_disk, trials)
        rt.close()
    return cold, memory, disk


def _hit_rate(model: Any, tokenizer: Any, disk_gb: float, pool_tokens: int,
              prefixes: int) -> float:
    """Token hit rate of 3 rounds over `prefixes` distinct prefixes that together need 4x the
    pool, each request one new token after its prefix."""
    size = pool_tokens * 4 // prefixes
    with tempfile.TemporaryDirectory() as tmp:
        rt = _runtime(model, tokenizer, Path(tmp), pool_tokens, disk_gb)
        heads = [random_prompt(rt.engine, size, seed=50 + i) for i in range(prefixes)]
        params = SamplingParams(max_new_tokens=1)
        for round_ in range(3):
            for i, head in enumerate(heads):
                rt.engine.generate(Request(head + [round_ * 97 + i + 5], params))
        stats = rt.cache.stats()
        rt.close()
    return ratio(stats.hit_tokens, stats.lookup_tokens)


def bench_tiers(model: Any, tokenizer: Any, small: int = 1000, large: int = 20_000,
                prompt_tokens: int = 1024, pool_tokens: int = 512, trials: int = 3,
                progress: Callable[[str], None] = lambda _: None) -> TiersResult:
    progress("save after a turn")
    save_small = _save_after_a_turn(model, tokenizer, small, trials)
    save_large = _save_after_a_turn(model, tokenizer, large, trials)
    progress("start-up")
    open_empty = _open(model, tokenizer, 0, trials)
    open_large = _open(model, tokenizer, large, trials)
    progress("time to first token")
    cold, memory, disk = _ttft(model, tokenizer, prompt_tokens, trials)
    progress("hit rate under pressure")
    with_tier = _hit_rate(model, tokenizer, 10.0, pool_tokens, 8)
    without = _hit_rate(model, tokenizer, 0.0, pool_tokens, 8)
    return TiersResult(small, large, save_small, save_large, open_empty, open_large,
                       prompt_tokens, cold, memory, disk, pool_tokens, 4 * pool_tokens,
                       with_tier, without)
