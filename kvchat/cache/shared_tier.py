"""The shared tier: blocks that other kvchat instances put in a store they share with this one.

An instance's radix tree knows only the blocks it computed (or spilled, or saved). A store that
several instances use (`BlockBackend.shared`: a folder on a shared file system, Redis/Valkey) also
holds the others' blocks, under the same chained keys (model fingerprint + namespace + every
token through the block), so a key names the same K/V on every instance with the same model,
and a tenant's salted namespace keeps its blocks apart on every instance alike.

    lookup:  tree match ──> keys of the prompt's next full blocks ──> batch_exists ──> get
             (memory, own disk)                                       (verified)   │
             the blocks read are stored into the pool as if computed <─────────────┘
             and the tree knows them from then on: that part of the hit is "shared"
    store:   every newly computed full block is put at once (write-through, queued, dropped
             when the queue is full), not only when it is evicted, so the others find it.

A partial last block is never shared (its key differs from the full block's), so a shared hit
ends on a block boundary. Nothing here raises for the store's sake: a store that is down
answers nothing and the lookup goes on from memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvchat.cache.block_backend import ReadStatus
from kvchat.cache.block_keys import chain_keys

if TYPE_CHECKING:
    from kvchat.cache.blocks import KV, Block
    from kvchat.cache.kvcache import PagedKVCache
    from kvchat.cache.radix import PrefixMatch


def active(cache: PagedKVCache) -> bool:
    store = cache.disk
    return store is not None and store.shared and store.enabled


def extend(cache: PagedKVCache, tokens: Sequence[int], namespace: str,
           match: PrefixMatch) -> tuple[PrefixMatch, int]:
    """`match` (resident: already loaded) continued by the blocks of `tokens` the shared
    store holds, which are stored into the pool; returns the new match and the tokens it
    gained. Holds no reference on return."""
    bs = cache.block_size
    n_full = len(tokens) // bs
    first = match.matched // bs
    store = cache.disk
    if store is None or match.disk or first >= n_full:
        return match, 0
    keys = chain_keys(tokens[: n_full * bs], bs, cache.tree.root_key(namespace)).full[first:]
    have = store.batch_exists(keys)
    read: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    for key in keys[: min(have, cache.manager.num_blocks // 2)]:  # never the whole pool
        got = store.get(key)
        if got.notice:
            cache.notice(got.notice)
        lo = (first + len(read)) * bs
        if got.status is not ReadStatus.HIT or got.kv is None \
                or list(got.tokens) != list(tokens[lo : lo + bs]):
            break
        read.append(got.kv)
    if not read:
        return match, 0
    end = (first + len(read)) * bs
    devices = cache.manager.devices
    kv: list[KV] = [
        (torch.cat([block[layer][0] for block in read], dim=1)[None].to(devices[layer]),
         torch.cat([block[layer][1] for block in read], dim=1)[None].to(devices[layer]))
        for layer in range(len(devices))
    ]  # per layer (1, H, len(read) * bs, D)
    cache.write_kv(tokens[:end], kv, first * bs, namespace=namespace)
    again = cache.tree.find_prefix(tokens, namespace)
    gained = max(min(again.matched, end) - match.matched, 0)
    return (again, gained) if gained else (match, 0)


def write_through(cache: PagedKVCache, tokens: Sequence[int], path: Sequence[Block],
                  first: int, namespace: str) -> None:
    """Put the full blocks of `path` (covering `tokens`) from block `first` on in the
    shared store, if there is one: the blocks a store just wrote into the pool."""
    store = cache.disk
    bs = cache.block_size
    n_full = min(len(tokens) // bs, len(path))
    if store is None or not active(cache) or first >= n_full:
        return
    keys = chain_keys(tokens[: n_full * bs], bs, cache.tree.root_key(namespace)).full
    for i in range(first, n_full):
        block = path[i]
        store.put(keys[i], block.token_ids, cache.manager.block_tensors(block.block_id),
                  wait=False)
