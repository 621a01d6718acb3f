"""Block handles and the BlockManager, the one owner of the K/V tensors.

The pool is one pre-allocated tensor per layer for K and one for V, shaped
(num_blocks, n_kv_heads, block_size, head_dim). Everyone else holds block ids (via Block handles);
only this module reads or writes the tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvchat.cache.stats import PoolStats

if TYPE_CHECKING:
    from kvchat.cache.radix_node import Node
    from kvchat.config import CacheConfig

KV = tuple[torch.Tensor, torch.Tensor]  # (K, V), each (1, n_kv_heads, T, head_dim)


class Block:
    """A handle on one slot of the pool: where the radix tree put it and who is reading it.

    The tree is the only owner of the tokens: a block placed in a node (`radix_node.place`)
    holds block `index` of that node's edge, and reads its tokens from there."""

    __slots__ = (
        "block_id",
        "block_size",
        "node",
        "index",
        "ref_count",
        "last_accessed",
        "attn_score",
    )

    def __init__(self, block_id: int, block_size: int) -> None:
        self.block_id = block_id
        self.block_size = block_size
        self.node: Node | None = None  # the tree node holding this block, None if in none
        self.index = 0  # which of node.blocks this is
        self.ref_count = 0
        self.last_accessed = 0
        self.attn_score = 0.0  # attention mass received, accumulated for H2O

    def acquire(self) -> None:
        self.ref_count += 1

    def release(self) -> None:
        if self.ref_count <= 0:
            raise RuntimeError(f"block {self.block_id} released more often than acquired")
        self.ref_count -= 1

    def clear(self) -> None:
        self.node = None
        self.index = 0
        self.ref_count = 0
        self.last_accessed = 0
        self.attn_score = 0.0

    @property
    def token_ids(self) -> list[int]:
        """The tokens this block holds: a fresh slice of its node's edge ([] in no node)."""
        if self.node is None:
            return []
        lo = self.index * self.block_size
        return self.node.tokens[lo : lo + self.block_size]

    @property
    def is_first_block(self) -> bool:
        """The block holds position 0 of a sequence (the attention sink eviction protects)."""
        return self.index == 0 and self.node is not None and self.node.start == 0

    @property
    def num_tokens(self) -> int:
        if self.node is None:
            return 0
        return max(min(len(self.node.tokens) - self.index * self.block_size, self.block_size), 0)

    def record(self) -> dict[str, Any]:
        """What a snapshot keeps of the block besides its K/V and the tree's tokens: the
        eviction policy's metadata."""
        return {"last_accessed": self.last_accessed, "attn_score": self.attn_score}

    def __repr__(self) -> str:
        return (
            f"Block(id={self.block_id}, tokens={self.num_tokens}/{self.block_size}, "
            f"ref={self.ref_count}, first={self.is_first_block})"
        )


class BlockManager:
    """Owns the per-layer K/V pools and the free list; allocates and frees blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        devices: Sequence[torch.device | str] | torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 1 or n_layers < 1:
            raise ValueError("num_blocks, block_size and n_layers must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        if isinstance(devices, (str, torch.device)):
            devices = [devices] * n_layers
        if len(devices) != n_layers:
            raise ValueError("one device per layer expected")
        self.devices = [torch.device(d) for d in devices]
        shape = (num_blocks, n_kv_heads, block_size, head_dim)
        # torch.empty: pages are touched only when written, so a large budget starts instantly.
        self.k_pool = [torch.empty(shape, dtype=dtype, device=d) for d in self.devices]
        self.v_pool = [torch.empty(shape, dtype=dtype, device=d) for d in self.devices]
        self.blocks = [Block(i, block_size) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @classmethod
    def for_config(
        cls,
        config: CacheConfig,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        devices: Sequence[torch.device | str] | torch.device | str = "cpu",
    ) -> BlockManager:
        """A pool of the blocks `config`'s budget holds at this K/V shape (`blocks_for`)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_token = 2 * n_layers * n_kv_heads * head_dim * itemsize
        return cls(config.blocks_for(per_token), config.block_size, n_layers, n_kv_heads,
                   head_dim, dtype, devices)

    # ---- bookkeeping -------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.n_layers * self.n_kv_heads * self.block_size * self.head_dim * itemsize

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def is_free(self, block_id: int) -> bool:
        return self._is_free[block_id]

    def allocate(self, n: int) -> list[Block]:
        """Pop n blocks from the free list, each acquired once for the caller."""
        if n > len(self.free_ids):
            raise MemoryError(f"asked for {n} blocks, {len(self.free_ids)} free")
        out = []
        for _ in range(n):
            bid = self.free_ids.popleft()
            self._is_free[bid] = False
            block = self.blocks[bid]
            block.clear()
            block.acquire()
            out.append(block)
        return out

    def free(self, blocks: Sequence[Block]) -> None:
        """Return unreferenced blocks to the free list."""
        for block in blocks:
            if block.ref_count != 0:
                raise RuntimeError(f"freeing {block!r} while it is referenced")
            if self._is_free[block.block_id]:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.clear()
            self._is_free[block.block_id] = True
            self.free_ids.append(block.block_id)

    def reset(self) -> None:
        """Every block back to the free list, references or not (a cache being emptied)."""
        for block in self.blocks:
            block.clear()
        self.free_ids = deque(range(self.num_blocks))
        self._is_free = [True] * self.num_blocks

    def stats(self) -> PoolStats:
        return PoolStats(
            block_size=self.block_size,
            total_blocks=self.num_blocks,
            used_blocks=self.num_blocks - len(self.free_ids),
            bytes_per_block=self.bytes_per_block,
        )

    # ---- tensor traffic ----------------------------------------------------------------------

    def _slots(self, block_ids: Sequence[int], offset: int, n: int, device: torch.device) -> tuple[
        torch.Tensor, torch.Tensor
    ]:
        """(block index, in-block offset) for n consecutive positions starting at `offset`
        within the concatenation of `block_ids`."""
        pos = torch.arange(offset, offset + n, device=device)
        table = torch.tensor(list(block_ids), dtype=torch.long, device=device)
        return table[pos // self.block_size], pos % self.block_size

    def write(self, block_ids: Sequence[int], offset: int, kv_per_layer: Sequence[KV]) -> None:
        """Write K/V for n consecutive positions into the blocks, starting `offset` tokens into
        the run of blocks. kv_per_layer[l] = (K, V), each (1, n_kv_heads, n, head_dim)."""
        if len(kv_per_layer) != self.n_layers:
            raise ValueError(f"expected K/V for {self.n_layers} layers, got {len(kv_per_layer)}")
        n = kv_per_layer[0][0].shape[-2]
        if n == 0:
            return
        if offset + n > len(block_ids) * self.block_size:
            raise ValueError("K/V run does not fit in the given blocks")
        slots: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, (k, v) in enumerate(kv_per_layer):
            dev = self.devices[layer]
            if dev not in slots:
                slots[dev] = self._slots(block_ids, offset, n, dev)
            blk, off = slots[dev]
            # pool[blk, :, off] is (n, H, D); the model gives (1, H, n, D)
            self.k_pool[layer][blk, :, off] = k[0].transpose(0, 1).to(dev, self.dtype)
            self.v_pool[layer][blk, :, off] = v[0].transpose(0, 1).to(dev, self.dtype)

    def copy_tokens(self, src: Block, dst: Block, n: int) -> None:
        """Copy the first n positions of src into dst (a branch that diverges mid-block)."""
        for layer in range(self.n_layers):
            self.k_pool[layer][dst.block_id, :, :n] = self.k_pool[layer][src.block_id, :, :n]
            self.v_pool[layer][dst.block_id, :, :n] = self.v_pool[layer][src.block_id, :, :n]

    def gather(self, block_ids: Sequence[int], n_tokens: int) -> list[KV]:
        """K/V of the first n_tokens positions covered by block_ids, per layer, each
        (1, n_kv_heads, n_tokens, head_dim): one indexed copy per layer."""
        if n_tokens > len(block_ids) * self.block_size:
            raise ValueError("n_tokens exceeds what the blocks hold")
        nb = len(block_ids)
        index: dict[torch.device, torch.Tensor] = {}
        out: list[KV] = []
        for layer in range(self.n_layers):
            dev = self.devices[layer]
            if dev not in index:
                index[dev] = torch.tensor(list(block_ids), dtype=torch.long, device=dev)
            ids = index[dev]
            shape = (1, self.n_kv_heads, nb * self.block_size, self.head_dim)
            # (H, NB, bs, D)[:, ids] -> (H, nb, bs, D), contiguous, so the view below is free
            k = self.k_pool[layer].transpose(0, 1)[:, ids].view(shape)[:, :, :n_tokens]
            v = self.v_pool[layer].transpose(0, 1)[:, ids].view(shape)[:, :, :n_tokens]
            out.append((k, v))
        return out

    # ---- persistence -------------------------------------------------------------------------

    def export_blocks(self, block_ids: Sequence[int]) -> list[KV]:
        """K/V of whole blocks, packed densely in the given order, on the CPU: per layer (K, V),
        each (len(block_ids), n_kv_heads, block_size, head_dim)."""
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        out: list[KV] = []
        for layer, dev in enumerate(self.devices):
            on_dev = ids.to(dev)
            out.append((self.k_pool[layer][on_dev].to("cpu").contiguous(),
                        self.v_pool[layer][on_dev].to("cpu").contiguous()))
        return out

    def import_blocks(self, records: Sequence[Mapping[str, Any]], kv: Sequence[KV]) -> list[Block]:
        """Allocate one block per record (as `Block.record` wrote it), restore its policy
        metadata, and write its K/V (export_blocks' layout). The blocks come back unreferenced
        and in no node: whoever registers them (the radix tree) owns them without a reference
        and gives them their tokens. On any error the blocks allocated here are freed again."""
        if len(kv) != self.n_layers:
            raise ValueError(f"expected K/V for {self.n_layers} layers, got {len(kv)}")
        blocks = self.allocate(len(records))
        try:
            for block, rec in zip(blocks, records, strict=True):
                block.release()
                block.last_accessed = int(rec["last_accessed"])
                block.attn_score = float(rec["attn_score"])
            ids = torch.tensor([b.block_id for b in blocks], dtype=torch.long)
            for layer, ((k, v), dev) in enumerate(zip(kv, self.devices, strict=True)):
                on_dev = ids.to(dev)
                self.k_pool[layer][on_dev] = k.to(dev, self.dtype)
                self.v_pool[layer][on_dev] = v.to(dev, self.dtype)
        except BaseException:
            for block in blocks:
                block.clear()  # drops the reference allocate took, if not released yet
            self.free(blocks)
            raise
        return blocks

    def block_tensors(self, block_id: int) -> list[KV]:
        """Views of one block in every layer (snapshots and tests)."""
        return [(self.k_pool[i][block_id], self.v_pool[i][block_id]) for i in range(self.n_layers)]


def fill_span(
    manager: BlockManager,
    new: list[Block],
    held: list[Block],
    extend: bool,
    span: tuple[int, int, int],
    skip_tokens: int,
    kv_per_layer: Sequence[KV],
) -> None:
    """Write positions [m, end) of a stored sequence (span = (base, m, end), base the start of
    m's block) into the held leaf's last block and/or the new blocks; a branch that diverges
    mid-block first copies the shared head of that block (see `PagedKVCache.write_kv`)."""
    base, m, end = span
    targets = [held[-1], *new] if extend else new
    if not extend and m > base:
        manager.copy_tokens(held[-1], new[0], m - base)
    window = [
        (k[:, :, m - skip_tokens : end - skip_tokens],
         v[:, :, m - skip_tokens : end - skip_tokens])
        for k, v in kv_per_layer
    ]
    manager.write([b.block_id for b in targets], m - base, window)
