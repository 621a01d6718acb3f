"""What the cache itself costs, measured within one run.

- tree: lookup of a cached prompt at several prompt lengths, store of a fresh prompt, and eviction
  per block, each at several cache sizes (blocks held in the tree). Lookup walks the prompt's own
  path, so its cost should grow with prompt length and not with cache size.
- bandwidth: gather and store of a prompt's K/V on a model-shaped pool, against a plain copy
  (`clone`) of a buffer of the same size, and, given a model, against that prompt's prefill.

Times are medians over trials after a warm-up, with min and max; ratios are taken within the run.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvchat.bench.results import (
    BandwidthResult,
    CacheBenchResult,
    LookupTiming,
    Timing,
    TreeRow,
)
from kvchat.bench.timing import measure, timed
from kvchat.cache.blocks import KV, BlockManager
from kvchat.cache.kvcache import PagedKVCache

# SmolLM2-135M: 30 layers, 3 KV heads of 64 dims.
SMOLLM2_SHAPE = (30, 3, 64)
VOCAB = 49_152

Progress = Callable[[str], None]


# ---- tree: lookup / store / evict vs cache size ----------------------------------------------


def _tree_cache(num_blocks: int, block_size: int, policy: str) -> PagedKVCache:
    # one layer, one head, one dim: the tensors are a token's worth of bytes, the tree is real
    manager = BlockManager(num_blocks, block_size, n_layers=1, n_kv_heads=1, head_dim=1)
    return PagedKVCache(manager, policy)


class _Filler:
    """Stores random token sequences shaped like chat traffic around the measured prompt: a
    quarter unrelated, a quarter sharing its first `system_tokens` tokens (a system prompt that
    ends mid-block, so all of them are siblings in one group on the prompt's path), a quarter
    branching off it at a random point (its path is split into many nodes), a quarter branching
    off any earlier sequence."""

    def __init__(self, cache: PagedKVCache, seed: int, vocab: int = VOCAB) -> None:
        self.cache = cache
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.seqs: list[list[int]] = []
        self._zeros = torch.zeros(1, 1, 0, 1)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def store(self, tokens: list[int]) -> int:
        """Store (zero K/V: the values do not matter here); returns blocks now in use."""
        n = len(tokens)
        if self._zeros.shape[2] < n:
            self._zeros = torch.zeros(1, 1, n, 1)
        kv = [(self._zeros[:, :, :n], self._zeros[:, :, :n])]
        self.cache.write_kv(tokens, kv, 0)
        return self.cache.manager.num_blocks - self.cache.manager.num_free

    def fill(
        self, target_blocks: int, new_tokens: int, anchor: list[int], system_tokens: int
    ) -> None:
        bs = self.cache.block_size
        used = self.cache.manager.num_blocks - self.cache.manager.num_free
        while used < target_blocks:
            fresh = self.tokens(min(new_tokens, (target_blocks - used) * bs))
            kind = self.rng.randrange(4)
            if kind == 0 or (kind == 3 and not self.seqs):
                seq = fresh
            elif kind == 1:
                seq = anchor[:system_tokens] + fresh
            else:
                base = anchor if kind == 2 else self.rng.choice(self.seqs)
                seq = base[: self.rng.randrange(1, len(base))] + fresh
            self.seqs.append(seq)
            used = self.store(seq)


def _tree_row(
    size: int,
    prompt_tokens: int,
    lengths: Sequence[int],
    block_size: int,
    policy: str,
    trials: int,
    evict_batch: int,
    fill_tokens: int,
    system_tokens: int,
    seed: int,
    progress: Progress | None,
) -> TreeRow:
    """Build a cache of `size` blocks around one prompt, then time operations on it while
    keeping it at that size."""
    if progress:
        progress(f"tree: filling {size:,} blocks")
    prompt_blocks = -(-prompt_tokens // block_size)
    # room for one more prompt and one eviction batch on top of the cached blocks
    cache = _tree_cache(size + prompt_blocks + evict_batch + 1, block_size, policy)
    filler = _Filler(cache, seed)
    prompt = filler.tokens(prompt_tokens)
    filler.store(prompt)
    filler.fill(size, fill_tokens, prompt, min(system_tokens, prompt_tokens - 1))

    if progress:
        progress(f"tree: lookups at {size:,} blocks")
    lookups = []
    for n in lengths:
        query = [*prompt[: min(n, prompt_tokens)], -1]  # -1 is never stored: matched == n

        def lookup(query: list[int] = query) -> float:
            hit = timed(lambda: cache.lookup(query))
            cache.release(hit.value.blocks)
            return hit.seconds

        lookups.append(LookupTiming(len(query) - 1, measure(lookup, trials, warmup=2)))

    # counted now: the stores and evictions below may take the prompt's blocks
    groups = [cache.tree.root, *(n for n, _ in cache.tree.nodes())]
    max_siblings = max((len(g) for n in groups for g in n.children.values()), default=0)
    node, path_nodes = cache.tree.find_prefix(prompt).node, 0
    while node is not None and node is not cache.tree.root:
        node, path_nodes = node.parent, path_nodes + 1

    if progress:
        progress(f"tree: stores at {size:,} blocks")
    zeros = torch.zeros(1, 1, prompt_tokens, 1)
    kv: list[KV] = [(zeros, zeros)]

    def store() -> float:
        seq = filler.tokens(prompt_tokens)
        res = timed(lambda: cache.write_kv(seq, kv, 0))
        cache.evict(prompt_blocks)  # back to `size`: the oldest blocks go, not the new ones
        return res.seconds

    store_t = measure(store, trials)

    if progress:
        progress(f"tree: evictions at {size:,} blocks")

    def evict() -> float:
        done = timed(lambda: cache.evict(evict_batch))
        filler.store(filler.tokens(done.value * block_size))  # refill to `size`
        return done.seconds / max(done.value, 1)

    evict_t = measure(evict, trials)
    stats = cache.stats()
    return TreeRow(
        cached_blocks=stats.pool.used_blocks,
        tree_nodes=stats.tree_nodes,
        tree_leaves=sum(1 for _ in cache.tree.leaves()),
        path_nodes=path_nodes,
        max_siblings=max_siblings,
        lookups=tuple(lookups),
        store=store_t,
        evict_per_block=evict_t,
    )


def bench_tree(
    sizes: Sequence[int] = (1_000, 10_000, 100_000),
    prompt_tokens: int = 4096,
    lengths: Sequence[int] = (512, 1024, 2048, 4096),
    block_size: int = 16,
    policy: str = "lru",
    trials: int = 15,
    evict_batch: int = 64,
    fill_tokens: int = 1024,
    system_tokens: int = 47,
    seed: int = 0,
    progress: Progress | None = None,
) -> list[TreeRow]:
    """One row per cache size, each on a cache built afresh."""
    min_size = -(-prompt_tokens // block_size) + 1
    return [
        _tree_row(
            max(size, min_size), prompt_tokens, lengths, block_size, policy, trials,
            evict_batch, fill_tokens, system_tokens, seed, progress,
        )
        for size in sizes
    ]


# ---- bandwidth: gather / store vs memcpy vs prefill ------------------------------------------


def _model_shape(model: Any) -> tuple[int, int, int, torch.dtype, torch.device]:
    cfg = model.config
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    param = next(model.parameters())
    return cfg.num_hidden_layers, kv_heads, head_dim, param.dtype, param.device


def _prefill(model: Any, tokens: int, device: torch.device, trials: int) -> Timing:
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, vocab, (1, tokens), generator=g).to(device)

    def run() -> float:
        with torch.inference_mode():
            return timed(lambda: model(input_ids=ids, use_cache=True), device).seconds

    return measure(run, trials)


def bench_bandwidth(
    tokens: int = 1024,
    shape: tuple[int, int, int] = SMOLLM2_SHAPE,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    block_size: int = 16,
    trials: int = 9,
    model: Any = None,
    prefill_trials: int = 3,
    progress: Progress | None = None,
) -> BandwidthResult:
    """Gather and store of `tokens` positions. With a model, the pool takes the model's shape,
    dtype and device, and the model's prefill of `tokens` tokens is timed in the same run."""
    n_layers, n_kv_heads, head_dim = shape
    dev = torch.device(device)
    if model is not None:
        n_layers, n_kv_heads, head_dim, dtype, dev = _model_shape(model)
    nb = -(-tokens // block_size)
    cache = PagedKVCache(
        BlockManager(nb, block_size, n_layers, n_kv_heads, head_dim, dtype, dev), "lru"
    )
    g = torch.Generator().manual_seed(0)
    seq = list(range(tokens))
    # (1, H, T, D) per layer, as a model's past_key_values gives them
    kv = [
        (
            torch.randn(1, n_kv_heads, tokens, head_dim, generator=g).to(dev, dtype),
            torch.randn(1, n_kv_heads, tokens, head_dim, generator=g).to(dev, dtype),
        )
        for _ in range(n_layers)
    ]
    kv_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)

    if progress:
        progress(f"bandwidth: store and gather of {tokens} tokens")

    def store() -> float:
        cache.clear()
        return timed(lambda: cache.write_kv(seq, kv, 0), dev).seconds

    store_t = measure(store, trials)
    cache.clear()
    res = cache.write_kv(seq, kv, 0, hold=True)  # held while gather reads them
    blocks = res.blocks

    gather_t = measure(lambda: timed(lambda: cache.gather(blocks, tokens), dev).seconds, trials)
    cache.release(blocks)
    flat = torch.randn(kv_bytes // torch.empty((), dtype=dtype).element_size(), generator=g).to(
        dev, dtype
    )

    memcpy_t = measure(lambda: timed(flat.clone, dev).seconds, trials)
    dst = torch.empty_like(flat)
    copy_t = measure(lambda: timed(lambda: dst.copy_(flat), dev).seconds, trials)
    prefill_t = None
    if model is not None:
        if progress:
            progress(f"bandwidth: prefill of {tokens} tokens")
        prefill_t = _prefill(model, tokens, dev, prefill_trials)
    return BandwidthResult(
        tokens=tokens,
        n_layers=n_layers,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        dtype=str(dtype).removeprefix("torch."),
        device=str(dev),
        kv_bytes=kv_bytes,
        gather=gather_t,
        store=store_t,
        memcpy=memcpy_t,
        copy=copy_t,
        prefill=prefill_t,
    )


# ---- the whole bench -------------------------------------------------------------------------


def run_cache_bench(
    model: Any = None,
    sizes: Sequence[int] = (1_000, 10_000, 100_000),
    prompt_tokens: int = 4096,
    lengths: Sequence[int] = (512, 1024, 2048, 4096),
    bandwidth_tokens: int = 1024,
    block_size: int = 16,
    policy: str = "lru",
    trials: int = 15,
    progress: Progress | None = None,
) -> CacheBenchResult:
    tree = bench_tree(
        sizes, prompt_tokens, lengths, block_size, policy, trials, progress=progress
    )
    bandwidth = bench_bandwidth(
        bandwidth_tokens,
        block_size=block_size,
        trials=max(3, trials // 2),
        model=model,
        progress=progress,
    )
    return CacheBenchResult(block_size, policy, prompt_tokens, trials, tuple(tree), bandwidth)
