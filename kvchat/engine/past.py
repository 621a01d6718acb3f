"""The transformers cache objects kvchat hands to a forward, and the K/V it reads back.

Gathered K/V from the pool is wrapped, not copied; decode buffers are reserved ahead so each step
writes its column in place; left-padded batches are packed by one function.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvchat.cache.blocks import KV
from kvchat.models.architectures import kv_heads


def _full_cache(config: Any) -> DynamicCache:
    """An empty DynamicCache whose layers all keep every position. Sliding-window layers would
    drop positions outside the window, and kvchat stores and reuses whole prefixes; the window
    itself is still applied by the attention mask the model builds from its config."""
    past = DynamicCache(config=config)
    past.layers = [DynamicLayer() for _ in past.layers]
    return past


def empty_past(config: Any) -> DynamicCache:
    return _full_cache(config)


def build_past(kv: Sequence[KV], config: Any) -> DynamicCache:
    """A DynamicCache holding copies of the given per-layer (1, H, T, D) K/V."""
    past = _full_cache(config)
    layers: list[Any] = list(past.layers)
    for layer, (k, v) in zip(layers, kv, strict=True):
        layer.update(k, v)
    return past


def wrap_past(kv: Sequence[KV], config: Any) -> DynamicCache:
    """A DynamicCache over the given per-layer (B, H, T, D) tensors, without copying them."""
    past = _full_cache(config)
    layers: list[Any] = list(past.layers)
    if len(layers) != len(kv):
        raise ValueError(f"model has {len(layers)} cache layers, got K/V for {len(kv)}")
    for layer, (k, v) in zip(layers, kv, strict=True):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return past


class _ReservedLayer(DynamicLayer):
    """A cache layer over a larger buffer: each forward writes its columns in place instead of
    concatenating (which copies the whole batch's K/V for that layer: a third of a padded
    32-row decode step on CPU).

    A one-row buffer hands attention its written columns only, exactly as a plain cache would,
    so one sequence decodes bitwise as transformers' own `generate` does. A batch hands over the
    whole buffer, its unwritten columns masked (the 2-D mask is padded up to the buffer's width,
    `get_mask_sizes`): a slice of several rows would be strided, which bfloat16 matmuls copy
    first (3x slower at 1,000 keys here)."""

    def __init__(self, k_buf: torch.Tensor, v_buf: torch.Tensor, length: int,
                 head: KV | None = None) -> None:
        super().__init__()
        self.lazy_initialization(k_buf, v_buf)
        self._len = length
        self.head = head  # (1, H, P, D) K/V every row sees before its own columns, or None
        self._k, self._v = k_buf, v_buf
        self.keys, self.values = k_buf, v_buf
        if k_buf.shape[0] == 1:
            self.keys, self.values = k_buf[:, :, :length], v_buf[:, :, :length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start = self._len
        end = start + key_states.shape[-2]
        if end > self._k.shape[-2]:
            raise ValueError(f"{end} positions do not fit a reserved cache of "
                             f"{self._k.shape[-2]}; reserve() more room before the forward")
        self._k[:, :, start:end] = key_states
        self._v[:, :, start:end] = value_states
        self._len = end
        keys, values = self._k, self._v
        if keys.shape[0] == 1:
            keys, values = keys[:, :, :end], values[:, :, :end]
        self.keys, self.values = keys, values
        return keys, values

    def written(self, end: int) -> None:
        """The buffers hold `end` positions now, written in place by a native layer
        (`native_layer`): what `update` records after writing them."""
        self._len = end
        if self._k.shape[0] == 1:
            self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]

    def get_seq_length(self) -> int:
        return self._len

    def grow(self, columns: int) -> None:
        pad = self._k.new_zeros(*self._k.shape[:2], columns, self._k.shape[-1])
        self._k = torch.cat([self._k, pad], dim=-2)
        self._v = torch.cat([self._v, pad], dim=-2)
        self.keys, self.values = self._k, self._v
        if self._k.shape[0] == 1:
            self.keys, self.values = self._k[:, :, : self._len], self._v[:, :, : self._len]

    def get_mask_sizes(self, query_length: int, *args: Any, **kwargs: Any) -> tuple[int, int]:
        if self._k.shape[0] == 1:
            return self._len + query_length, 0
        return self._k.shape[-2], 0


def reserved_past(buffers: Sequence[KV], length: int, config: Any,
                  head: Sequence[KV] | None = None) -> DynamicCache:
    """A DynamicCache over the first `length` positions of per-layer (B, H, capacity, D)
    buffers; later positions are written in place as the batch runs. With `head` (per layer
    (1, H, P, D)), every row's positions [0, P) are those, held once, and the buffers hold what
    follows: only an attention that reads `shared_head(layer)` (the fused forward's) may run it."""
    past = DynamicCache(config=config)
    if len(past.layers) != len(buffers) or (head is not None and len(head) != len(buffers)):
        raise ValueError(f"model has {len(past.layers)} cache layers, got {len(buffers)}")
    past.layers = [_ReservedLayer(k, v, length, head[i] if head is not None else None)
                   for i, (k, v) in enumerate(buffers)]
    return past


def shared_head(layer: Any) -> KV | None:
    """The K/V every row of a `reserved_past` layer starts with, held once; None if none."""
    return getattr(layer, "head", None)


def has_head(past: Any) -> bool:
    layers: list[Any] = list(getattr(past, "layers", ()))
    return bool(layers) and shared_head(layers[0]) is not None


def reserve(past: DynamicCache, columns: int) -> None:
    """Make every layer of a `reserved_past` `columns` wider (before the forward that needs
    them: the attention mask is sized from the width)."""
    for layer in past.layers:
        if isinstance(layer, _ReservedLayer):
            layer.grow(columns)


def past_length(past: DynamicCache) -> int:
    """Positions present in every layer (an interrupted forward can leave layers uneven)."""
    layers: list[Any] = list(past.layers)
    lengths = [layer.get_seq_length() for layer in layers]
    return min(lengths) if lengths else 0


def past_kv(past: DynamicCache, start: int, end: int) -> list[KV]:
    """Per layer (B, H, end - start, D) views of positions [start, end)."""
    layers: list[Any] = list(past.layers)
    return [(layer.keys[:, :, start:end], layer.values[:, :, start:end]) for layer in layers]


class Pieces:
    """One sequence's K/V for positions [0, length) as consecutive runs of per-layer
    (1, H, n, D) tensors: a past several sequences share, then its own. Read by range: views
    when the range lies in one run, a copy only when it spans two."""

    def __init__(self, *runs: Sequence[KV]) -> None:
        given = [list(run) for run in runs if run]
        self._layout = given[0] if given else []  # what an empty range is a view of
        self.runs = [run for run in given if run[0][0].shape[2]]

    def range(self, start: int, end: int) -> list[KV]:
        parts: list[list[KV]] = []
        lo = 0
        for run in self.runs:
            n = run[0][0].shape[2]
            a, b = max(start, lo), min(end, lo + n)
            if a < b:
                parts.append([(k[:, :, a - lo : b - lo], v[:, :, a - lo : b - lo])
                              for k, v in run])
            lo += n
        if not parts:  # an empty range: zero-width views, one per layer
            return [(k[:, :, :0], v[:, :, :0]) for k, v in self._layout]
        if len(parts) == 1:
            return parts[0]
        return [(torch.cat([p[i][0] for p in parts], dim=2),
                 torch.cat([p[i][1] for p in parts], dim=2)) for i in range(len(parts[0]))]


def pack_right_aligned(rows: Sequence[Sequence[KV] | None], lengths: Sequence[int], width: int,
                       capacity: int, like: Sequence[KV]) -> list[KV]:
    """Per-layer (B, H, capacity, D) buffers holding row i's first lengths[i] positions in
    columns [width - lengths[i], width): left padding, so every row's next position is column
    `width`. Rows given as None (or of length 0) stay all padding."""
    out: list[KV] = []
    for layer, (k0, _) in enumerate(like):
        shape = (len(rows), k0.shape[1], capacity, k0.shape[3])
        keys, values = k0.new_zeros(shape), k0.new_zeros(shape)
        for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            if row is not None and n:
                keys[i, :, width - n : width] = row[layer][0][0, :, :n]
                values[i, :, width - n : width] = row[layer][1][0, :, :n]
        out.append((keys, values))
    return out


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a decoder config."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads(config), head_dim


def layer_devices(model: Any, n_layers: int) -> list[torch.device]:
    """The device of each decoder layer, so the pool for layer i lives where layer i runs."""
    fallback = next(model.parameters()).device
    decoder: Any = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers: Any = getattr(decoder, "layers", None)
    if layers is None or len(layers) != n_layers:
        return [fallback] * n_layers
    return [next(layer.parameters()).device for layer in layers]
