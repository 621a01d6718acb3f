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
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvchat.cache.blocks import KV, BlockManager
from kvchat.cache.kvcache import PagedKVCache

# SmolLM2-135M: 30 layers, 3 KV heads of 64 dims.
SMOLLM2_SHAPE = (30, 3, 64)
PREFILL_TARGET = 0.02  # gather should cost under 2% of the prefill it replaces
VOCAB = 49_152

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Timing:
    """Seconds: median, min and max over the trials."""

    median_s: float
    min_s: float
    max_s: float

    def per(self, n: int) -> Timing:
        return Timing(self.median_s / n, self.min_s / n, self.max_s / n)


def measure(trial: Callable[[], float], trials: int, warmup: int = 1) -> Timing:
    """`trial` runs once and returns the seconds of its timed part (setup stays outside)."""
    for _ in range(warmup):
        trial()
    samples = [trial() for _ in range(max(1, trials))]
    return Timing(statistics.median(samples), min(samples), max(samples))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- tree: lookup / store / evict vs cache size ----------------------------------------------


@dataclass(frozen=True)
class LookupTiming:
    prompt_tokens: int
    timing: Timing

    @property
    def ns_per_token(self) -> float:
        return self.timing.median_s / self.prompt_tokens * 1e9


@dataclass(frozen=True)
class TreeRow:
    cached_blocks: int  # blocks in the tree while measuring
    tree_nodes: int
    tree_leaves: int
    path_nodes: int  # nodes on the measured prompt's path: what a lookup walks
    max_siblings: int  # the largest group of siblings sharing a first token
    lookups: tuple[LookupTiming, ...]  # a full hit, one per prompt length
    store: Timing  # a fresh prompt of `prompt_tokens`, pool not full
    evict_per_block: Timing


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
        res = self.cache.store(tokens, kv, 0)
        self.cache.release(res.blocks)
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
            t = time.perf_counter()
            hit = cache.lookup(query)
            dt = time.perf_counter() - t
            cache.release(hit.blocks)
            return dt

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
        t = time.perf_counter()
        res = cache.store(seq, kv, 0)
        dt = time.perf_counter() - t
        cache.release(res.blocks)
        cache.evict(prompt_blocks)  # back to `size`: the oldest blocks go, not the new ones
        return dt

    store_t = measure(store, trials)

    if progress:
        progress(f"tree: evictions at {size:,} blocks")

    def evict() -> float:
        t = time.perf_counter()
        done = cache.evict(evict_batch)
        dt = time.perf_counter() - t
        filler.store(filler.tokens(done * block_size))  # refill to `size`
        return dt / max(done, 1)

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


@dataclass(frozen=True)
class BandwidthResult:
    tokens: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    device: str
    kv_bytes: int  # K and V of `tokens` positions, all layers
    gather: Timing
    store: Timing
    memcpy: Timing  # clone of one buffer of kv_bytes: allocate + copy, as gather does
    copy: Timing  # copy_ into a preallocated buffer: no page faults, the machine's peak
    prefill: Timing | None  # the model's forward over `tokens` fresh tokens, if a model was given

    @property
    def gather_gb_s(self) -> float:
        return self.kv_bytes / self.gather.median_s / 1e9

    @property
    def store_gb_s(self) -> float:
        return self.kv_bytes / self.store.median_s / 1e9

    @property
    def memcpy_gb_s(self) -> float:
        return self.kv_bytes / self.memcpy.median_s / 1e9

    @property
    def copy_gb_s(self) -> float:
        return self.kv_bytes / self.copy.median_s / 1e9

    @property
    def gather_vs_prefill(self) -> float | None:
        return None if self.prefill is None else self.gather.median_s / self.prefill.median_s

    @property
    def store_vs_prefill(self) -> float | None:
        return None if self.prefill is None else self.store.median_s / self.prefill.median_s


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
            _sync(device)
            t = time.perf_counter()
            model(input_ids=ids, use_cache=True)
            _sync(device)
            return time.perf_counter() - t

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
        _sync(dev)
        t = time.perf_counter()
        res = cache.store(seq, kv, 0)
        _sync(dev)
        dt = time.perf_counter() - t
        cache.release(res.blocks)
        return dt

    store_t = measure(store, trials)
    cache.clear()
    res = cache.store(seq, kv, 0)
    blocks = res.blocks

    def gather() -> float:
        _sync(dev)
        t = time.perf_counter()
        cache.gather(blocks, tokens)
        _sync(dev)
        return time.perf_counter() - t

    gather_t = measure(gather, trials)
    cache.release(blocks)
    flat = torch.randn(kv_bytes // torch.empty((), dtype=dtype).element_size(), generator=g).to(
        dev, dtype
    )

    def memcpy() -> float:
        _sync(dev)
        t = time.perf_counter()
        flat.clone()
        _sync(dev)
        return time.perf_counter() - t

    memcpy_t = measure(memcpy, trials)
    dst = torch.empty_like(flat)

    def copy() -> float:
        _sync(dev)
        t = time.perf_counter()
        dst.copy_(flat)
        _sync(dev)
        return time.perf_counter() - t

    copy_t = measure(copy, trials)
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


@dataclass(frozen=True)
class CacheBenchResult:
    block_size: int
    policy: str
    prompt_tokens: int
    trials: int
    tree: tuple[TreeRow, ...]
    bandwidth: BandwidthResult

    @property
    def lookup_size_ratio(self) -> float:
        """Lookup of the full prompt at the largest cache over the same at the smallest."""
        def full(row: TreeRow) -> float:
            return max(row.lookups, key=lambda lk: lk.prompt_tokens).timing.median_s

        return full(self.tree[-1]) / full(self.tree[0])

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for row, row_out in zip(self.tree, out["tree"], strict=True):
            for lk, lk_out in zip(row.lookups, row_out["lookups"], strict=True):
                lk_out["ns_per_token"] = lk.ns_per_token
        bw = self.bandwidth
        out["bandwidth"].update(
            gather_gb_s=bw.gather_gb_s,
            store_gb_s=bw.store_gb_s,
            memcpy_gb_s=bw.memcpy_gb_s,
            copy_gb_s=bw.copy_gb_s,
            gather_vs_prefill=bw.gather_vs_prefill,
            store_vs_prefill=bw.store_vs_prefill,
        )
        out["lookup_size_ratio"] = self.lookup_size_ratio
        return out


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


# ---- rendering -------------------------------------------------------------------------------


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    if s >= 1e-6:
        return f"{s * 1e6:.1f} µs"
    return f"{s * 1e9:.0f} ns"


def _cell(t: Timing) -> Text:
    text = Text(fmt_seconds(t.median_s))
    text.append(f"\n{fmt_seconds(t.min_s)}–{fmt_seconds(t.max_s)}", style="dim")
    return text


def render_cache_bench(result: CacheBenchResult) -> RenderableType:
    """Two tables and the ratios they back; a pure function of the result."""
    lengths = [lk.prompt_tokens for lk in result.tree[0].lookups] if result.tree else []
    tree = Table(
        title=f"Cache operations vs cache size (block size {result.block_size}, "
        f"{result.policy}; median, min–max of {result.trials})",
        title_justify="left",
    )
    tree.add_column("cached blocks", justify="right")
    tree.add_column("nodes / leaves\n(on path, siblings)", justify="right")
    for n in lengths:
        tree.add_column(f"lookup {n:,}", justify="right")
    tree.add_column(f"store {result.prompt_tokens:,}", justify="right")
    tree.add_column("evict / block", justify="right")
    for row in result.tree:
        tree.add_row(
            f"{row.cached_blocks:,}",
            f"{row.tree_nodes:,} / {row.tree_leaves:,}\n"
            f"({row.path_nodes:,}, {row.max_siblings:,})",
            *[_cell(lk.timing) for lk in row.lookups],
            _cell(row.store),
            _cell(row.evict_per_block),
        )
    notes = Text()
    if result.tree:
        last = result.tree[-1]
        per_token = ", ".join(
            f"{lk.ns_per_token:.0f} ns ({lk.prompt_tokens:,})" for lk in last.lookups
        )
        notes.append(f"Lookup per prompt token at {last.cached_blocks:,} blocks: {per_token}\n")
        notes.append(
            f"Lookup of {result.prompt_tokens:,} tokens at {last.cached_blocks:,} vs "
            f"{result.tree[0].cached_blocks:,} cached blocks: {result.lookup_size_ratio:.2f}x\n"
        )

    bw = result.bandwidth
    band = Table(
        title=f"K/V traffic for {bw.tokens:,} tokens ({bw.n_layers} layers x {bw.n_kv_heads} "
        f"KV heads x {bw.head_dim}, {bw.dtype}, {bw.device}: {bw.kv_bytes / 2**20:.1f} MiB)",
        title_justify="left",
    )
    band.add_column("operation")
    band.add_column("time", justify="right")
    band.add_column("GB/s", justify="right")
    band.add_column("vs memcpy", justify="right")
    band.add_row("gather (pool -> K/V)", _cell(bw.gather), f"{bw.gather_gb_s:.1f}",
                 f"{bw.gather_gb_s / bw.memcpy_gb_s:.2f}x")
    band.add_row("store (K/V -> pool)", _cell(bw.store), f"{bw.store_gb_s:.1f}",
                 f"{bw.store_gb_s / bw.memcpy_gb_s:.2f}x")
    band.add_row("memcpy (clone)", _cell(bw.memcpy), f"{bw.memcpy_gb_s:.1f}", "1.00x")
    band.add_row("copy_ (preallocated)", _cell(bw.copy), f"{bw.copy_gb_s:.1f}",
                 f"{bw.copy_gb_s / bw.memcpy_gb_s:.2f}x")
    if bw.prefill is not None:
        band.add_row(f"prefill {bw.tokens:,} tokens", _cell(bw.prefill), "", "")
    if bw.gather_vs_prefill is not None and bw.store_vs_prefill is not None:
        ok = bw.gather_vs_prefill < PREFILL_TARGET
        notes.append(
            f"gather / prefill = {bw.gather_vs_prefill:.2%} (target < {PREFILL_TARGET:.0%}: "
            f"{'met' if ok else 'missed'}); store / prefill = {bw.store_vs_prefill:.2%}",
            style="green" if ok else "red",
        )
    else:
        notes.append("gather / prefill: no model given", style="dim")
    return Group(tree, band, notes)
