"""Model-free helpers for the cache tests: a reference K/V that depends only on the token prefix,
small pools, and store/lookup round trips that check the cache's integrity on the way."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from kvchat.cache.blocks import KV, Block, BlockManager
from kvchat.cache.eviction import EvictionPolicy
from kvchat.cache.kvcache import PagedKVCache
from kvchat.cache.lookup import Lookup, StoreResult
from kvchat.cache.radix_node import Node

N_LAYERS = 2
N_KV_HEADS = 2
HEAD_DIM = 4
_PRIME = 1_000_003


def prefix_seeds(tokens: Sequence[int]) -> list[int]:
    """seed[i] is a function of tokens[: i + 1] only, as K/V at position i is in a causal model."""
    seeds = []
    h = 0x345678
    for t in tokens:
        h = hash((h, t))
        seeds.append(h % _PRIME)
    return seeds


def ref_kv(
    tokens: Sequence[int],
    start: int = 0,
    end: int | None = None,
    n_layers: int = N_LAYERS,
    n_kv_heads: int = N_KV_HEADS,
    head_dim: int = HEAD_DIM,
) -> list[KV]:
    """K/V for positions [start, end) of `tokens`, per layer, each (1, H, end - start, D)."""
    end = len(tokens) if end is None else end
    seeds = torch.tensor(prefix_seeds(tokens)[start:end], dtype=torch.int64)
    per_pos = 2 * n_layers * n_kv_heads * head_dim
    elem = torch.arange(per_pos, dtype=torch.int64)
    # (T, per_pos) integers below _PRIME: exact in float32's mantissa after the division below
    vals = (seeds[:, None] * 7919 + elem[None, :] * 104_729 + 1) % _PRIME
    x = (vals.to(torch.float32) / _PRIME).view(end - start, n_layers, 2, n_kv_heads, head_dim)
    x = x.permute(1, 2, 3, 0, 4)  # (L, 2, H, T, D)
    return [(x[i, 0][None].contiguous(), x[i, 1][None].contiguous()) for i in range(n_layers)]


def make_manager(
    num_blocks: int = 16, block_size: int = 4, n_layers: int = N_LAYERS
) -> BlockManager:
    return BlockManager(num_blocks, block_size, n_layers, N_KV_HEADS, HEAD_DIM)


def in_node(blocks: Sequence[Block], tokens: Sequence[int], start: int = 0) -> Node:
    """A detached node holding `tokens` in `blocks`, each block pointing back at it as the
    radix tree places blocks: where a block reads its tokens and first-block flag from."""
    node = Node(None, start, list(tokens), list(blocks))
    for i, block in enumerate(blocks):
        block.node, block.index = node, i
    return node


def make_cache(
    num_blocks: int = 16,
    block_size: int = 4,
    policy: EvictionPolicy | str | None = "lru",
    max_exact_entries: int = 256,
) -> PagedKVCache:
    return PagedKVCache(make_manager(num_blocks, block_size), policy, max_exact_entries)


def make_tiered_cache(
    root: Path,
    num_blocks: int = 16,
    block_size: int = 4,
    budget_bytes: int = 1 << 30,
    policy: EvictionPolicy | str | None = "lru",
    shared: bool = False,
    namespace_fp: str = "test",
) -> PagedKVCache:
    """A cache whose evicted blocks spill to a BlockStore in `root` (close it: cache.disk);
    `shared`: other caches use the same folder (`shared_tier`)."""
    from kvchat.cache.block_file import BlockLayout
    from kvchat.cache.block_store import BlockStore

    cache = make_cache(num_blocks, block_size, policy)
    store = BlockStore(root, BlockLayout.of(cache.manager), budget_bytes, index_every_s=0.05,
                       shared=shared)
    cache.use_store(store, {"model": namespace_fp})
    return cache


def store(
    cache: PagedKVCache,
    tokens: Sequence[int],
    skip: int = 0,
    logits: torch.Tensor | None = None,
    hold: bool = False,
    sid: str | None = None,
    logits_len: int | None = None,
) -> StoreResult:
    """Store `tokens` with reference K/V for [skip, n) (the result's blocks held for the caller
    only with hold=True); check integrity."""
    kv = ref_kv(tokens, skip)
    res = cache.write_kv(tokens, kv, skip, logits=logits, logits_len=logits_len, sid=sid, hold=hold)
    cache.check_integrity()
    return res


def assert_kv_equal(got: Sequence[KV], want: Sequence[KV]) -> None:
    assert len(got) == len(want)
    for layer, ((gk, gv), (wk, wv)) in enumerate(zip(got, want, strict=True)):
        assert gk.shape == wk.shape, f"layer {layer} K shape {tuple(gk.shape)} != {tuple(wk.shape)}"
        assert gv.shape == wv.shape, f"layer {layer} V shape {tuple(gv.shape)} != {tuple(wv.shape)}"
        assert torch.equal(gk, wk), f"layer {layer} K differs"
        assert torch.equal(gv, wv), f"layer {layer} V differs"


def assert_hit_correct(cache: PagedKVCache, hit: Lookup, tokens: Sequence[int]) -> None:
    """The K/V a hit reads back equal what the reference model gives for the matched prefix."""
    got = cache.gather(hit.blocks, hit.matched)
    assert_kv_equal(got, ref_kv(tokens, 0, hit.matched))


def fetch(cache: PagedKVCache, tokens: Sequence[int]) -> Lookup:
    """Lookup, verify the K/V, release: a read that leaves ref counts as they were."""
    hit = cache.lookup(tokens)
    cache.check_integrity()
    assert_hit_correct(cache, hit, tokens)
    cache.release(hit.blocks)
    cache.check_integrity()
    return hit
