"""A decoder layer in one native call (models/decode_layer.c): the fused decode forward's
commonest step, one row and one new token, without the dozen Python calls between kernels that
`fused_decode._layer` makes. It takes layers whose norms run kvchat's native norm (q / k norms
and Gemma's norms after attention and MLP too), int4 weights on kvchat's kernel (q / k / v
biases in bfloat16 too), an elementwise activation, attention with or without Gemma 2's
soft-cap on its scores (the attention kernel applies it) and a reserved one-row cache. The C runs
that method's kernels in its order and rounds as torch does between them (the activation is
torch's own, a table of every bfloat16 value), so a sequence gets the same bits either way;
tests hold the two to it. Anything else, or any check that fails, runs `_layer`."""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch import nn

from kvchat.engine.fused_norms import Norm
from kvchat.engine.past import _ReservedLayer
from kvchat.models.layer_ops import NormWeight, norm_flags, runs_natively
from kvchat.models.native import library

# torch's SiLU may round a value in its vector loop's tail (done one at a time) otherwise than
# in the body: the C matches the body, so the MLP's width must fill whole vectors (2 x 32
# bfloat16 on AVX-512, 2 x 16 on AVX2), and stay below the size torch splits over threads (a
# split could leave a tail in the middle)
_VECTOR, _GRAIN = 64, 32768
_void, _long, _float, _int = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int


class _Int4(ctypes.Structure):
    _fields_ = [("q", _void), ("scales", _void), ("zeros", _void), ("n", _long), ("k", _long)]


class _Norm(ctypes.Structure):  # decode_layer.c's norm_t; w None: the layer has none there
    _fields_ = [("w", _void), ("rest", _void), ("split", _long), ("eps", _float),
                ("flags", _int)]


class _LayerArgs(ctypes.Structure):  # decode_layer.c's layer_t
    _fields_ = [("norm1", _Norm), ("norm2", _Norm), ("qk", _Norm), ("post_attn", _Norm),
                ("post_mlp", _Norm), ("qkv", _Int4), ("o", _Int4), ("gate_up", _Int4),
                ("down", _Int4), ("hidden", _long), ("heads", _long), ("kv_heads", _long),
                ("dim", _long), ("rotary", _long), ("inter", _long), ("scaling", _float),
                ("softcap", _float), ("act", _void), ("qkv_bias", _void)]


# the layer's norms: its args slot, and the dtype of what it norms (the float32 stream, or a
# kernel's bfloat16 output), as `fused_decode._layer` calls them
_NORMS = (("norm1", "norm1", torch.float32), ("norm2", "norm2", torch.float32),
          ("qk", "qk_norm", torch.bfloat16), ("post_attn", "post_attn", torch.bfloat16),
          ("post_mlp", "post_mlp", torch.bfloat16))


def activation_table(act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """`act` (an elementwise activation) of every bfloat16, indexed by its bits: (65536,)
    int16, torch's own values; None where it does not give bfloat16 back."""
    signed = torch.arange(-32768, 32768, dtype=torch.int16)
    values = torch.cat([signed[32768:], signed[:32768]]).view(torch.bfloat16)  # 0x0000 ...
    # in pieces of whole vectors below torch's thread split: each value in a loop's body
    pieces = [act(values[i : i + 4096]) for i in range(0, 65536, 4096)]
    if any(piece.dtype != torch.bfloat16 or piece.shape != (4096,) for piece in pieces):
        return None
    return torch.cat(pieces).view(torch.int16).contiguous()


@cache
def silu_table() -> torch.Tensor:
    """torch's bfloat16 SiLU of every bfloat16, indexed by its bits: (65536,) int16."""
    table = activation_table(nn.functional.silu)
    assert table is not None
    return table


def _int4(mm: Any, n: int, k: int) -> _Int4 | None:
    weights = getattr(mm, "weights", None)
    if weights is None:
        return None
    q, scales, zeros = weights
    if q.shape[0] != n or q.shape[1] * 2 != k:
        return None
    return _Int4(q.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n, k)


class NativeLayer:
    """`NativeLayer.build(layer, hidden)`: the native call for one fused layer (`fused_decode`'s
    _Layer), or None where its shape is not the one decode_layer.c runs."""

    def __init__(self, args: _LayerArgs, norms: dict[str, tuple[Norm, torch.dtype]],
                 keep: tuple[Any, ...]) -> None:
        self.args = args
        self.norms = norms  # slot: (the fused layer's norm, the dtype it norms)
        self.held: dict[str, NormWeight] = {}
        self.keep = keep  # the tensors args points into
        self.kernel = library().kvchat_decode_layer  # type: ignore[union-attr]
        self.address = ctypes.addressof(args)
        # the K/V buffers checked last
        self._buffers: tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]] | None = None

    @classmethod
    def build(cls, layer: Any, hidden: int) -> NativeLayer | None:
        lib = library()
        d, heads, kv_heads, inter = layer.head_dim, layer.heads, layer.kv_heads, layer.intermediate
        norms = {slot: (getattr(layer, name), dtype) for slot, name, dtype in _NORMS
                 if getattr(layer, name) is not None}
        if (lib is None or inter % _VECTOR or inter >= _GRAIN
                or not all(norm.native for norm, _ in norms.values())
                or norms["norm1"][0].heads is not None or norms["norm2"][0].heads is not None):
            return None
        width = (heads + 2 * kv_heads) * d  # q, k and v stacked
        parts = (_int4(layer.qkv, width, hidden),
                 _int4(layer.o, hidden, heads * d), _int4(layer.gate_up, 2 * inter, hidden),
                 _int4(layer.down, hidden, inter))
        table = silu_table() if layer.act is nn.functional.silu else activation_table(layer.act)
        bias = getattr(layer.qkv, "bias", None)  # Qwen2's q / k / v biases, stacked
        if any(part is None for part in parts) or table is None \
                or getattr(layer.gate_up, "bias", None) is not None \
                or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_cpu
                                          or bias.shape != (width,) or not bias.is_contiguous())):
            return None
        args = _LayerArgs(_Norm(), _Norm(), _Norm(), _Norm(), _Norm(), *parts, hidden, heads,
                          kv_heads, d, d, inter, layer.scaling, layer.softcap or 0.0,
                          table.data_ptr(),
                          None if bias is None else bias.data_ptr())
        keep = (table, bias, layer.qkv, layer.o, layer.gate_up, layer.down)
        return cls(args, norms, keep)

    def _norms_ready(self) -> bool:
        """The norms' weights as the modules hold them now, in args (taken again when a module
        was given another weight); False where one would not give the fused layer's bfloat16
        (a float32 weight of a Llama-formula norm over bfloat16 promotes its output)."""
        for slot, (norm, dtype) in self.norms.items():
            weights = norm.weights()
            if weights is self.held.get(slot):
                continue
            weight, other = weights.weight, weights.other
            out = torch.bfloat16 if dtype == torch.float32 or weights.gemma else \
                torch.promote_types(weight.dtype, dtype)
            if out != torch.bfloat16 or not runs_natively(_PROBES[dtype], weights, out) \
                    or not weight.is_contiguous() \
                    or (other is not None and not other.is_contiguous()):
                return False
            rest = other if other is not None else weight
            setattr(self.args, slot, _Norm(weight.data_ptr(), rest.data_ptr(),
                                           weights.split if other is not None else 1,
                                           weights.eps,
                                           norm_flags(dtype, weight.dtype, weights.gemma, out)))
            self.held[slot] = weights
        return True

    def _rotary(self, dims: int) -> bool:
        """The rotary table's width in args: the head's, or its first `dims` (Phi-3)."""
        if dims != self.args.rotary:
            if dims > self.args.dim or dims % 2 or dims <= 0:
                return False
            self.args.rotary = dims
        return True

    def takes_cache(self, cache: Any) -> bool:
        """Whether the layer runs over `cache` now (a reserved one-row cache with room for the
        token, its buffers checked once) with its norms' weights as they are now."""
        if type(cache) is not _ReservedLayer or cache.head is not None:
            return False
        k_buf, v_buf = cache._k, cache._v
        held = self._buffers
        if held is None or held[0]() is not k_buf or held[1]() is not v_buf:
            if (k_buf.shape[0] != 1 or k_buf.dtype != torch.bfloat16
                    or v_buf.dtype != torch.bfloat16 or not k_buf.is_contiguous()
                    or not v_buf.is_contiguous()):
                return False
            self._buffers = (weakref.ref(k_buf), weakref.ref(v_buf))  # not kept alive here
        return cache._len < k_buf.shape[2] and self._norms_ready()

    def run(self, hidden: torch.Tensor, cache: Any, cos: torch.Tensor, sin: torch.Tensor
            ) -> bool:
        """The layer over `hidden` ((1, width) float32, updated in place) and its cache layer,
        the new token's K/V written at its position; False (nothing done) where it does not
        run here."""
        if not (self.takes_cache(cache) and self._rotary(cos.shape[-1])
                and _takes_table(cos, sin)):
            return False
        k_buf, v_buf, pos = cache._k, cache._v, cache._len
        _check(self.kernel(self.address, hidden.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                           k_buf.data_ptr(), v_buf.data_ptr(), k_buf.shape[2], pos,
                           torch.get_num_threads()))
        cache.written(pos + 1)
        return True


def _takes_table(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether a rotary table is one the native layer reads."""
    return cos.dtype == torch.bfloat16 and sin.dtype == torch.bfloat16 \
        and cos.is_contiguous() and sin.is_contiguous()


def _check(rc: int) -> None:
    if rc == -2:
        raise MemoryError("decode layer: no memory for its activations")
    if rc != 0:
        raise ValueError("decode layer: the kernels refused its shapes")


class NativeStack:
    """Every layer of a lone row's decode step in one native call (decode_layer.c's
    kvchat_decode_layers, which calls each layer's kernel in turn): the Python between 24 or
    more layer calls goes, and with it the cache misses it costs after each layer's weights
    have streamed through. The same kernels in the same order as `NativeLayer.run` on each
    layer, so the same bits; tests hold the two to it."""

    def __init__(self, layers: list[NativeLayer]) -> None:
        self.layers = layers
        self.kernel = library().kvchat_decode_layers  # type: ignore[union-attr]
        self._pointers = ctypes.c_void_p * len(layers)
        self._longs = ctypes.c_long * len(layers)
        self.args = self._pointers(*(layer.address for layer in layers))

    def run(self, hidden: torch.Tensor, caches: list[Any],
            tables: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Every layer over `hidden` ((1, width) float32, updated in place), layer i over
        caches[i] with rotary table tables[i]; False, with nothing written, where one of them
        would not run natively. The call's arrays are its own: runners sharing the stack may
        run at once."""
        n = len(self.layers)
        cos_at, sin_at, k_at, v_at = (self._pointers() for _ in range(4))
        capacity, pos = self._longs(), self._longs()
        checked: list[tuple[torch.Tensor, torch.Tensor]] = []  # a step's tables: one a kind
        for i, layer in enumerate(self.layers):
            cache, (cos, sin) = caches[i], tables[i]
            if not (layer.takes_cache(cache) and layer._rotary(cos.shape[-1])):
                return False
            if not any(c is cos and s is sin for c, s in checked):
                if not _takes_table(cos, sin):
                    return False
                checked.append((cos, sin))
            k_buf, v_buf = cache._k, cache._v
            cos_at[i], sin_at[i] = cos.data_ptr(), sin.data_ptr()
            k_at[i], v_at[i] = k_buf.data_ptr(), v_buf.data_ptr()
            capacity[i], pos[i] = k_buf.shape[2], cache._len
        _check(self.kernel(self.args, n, hidden.data_ptr(), cos_at, sin_at, k_at, v_at,
                           capacity, pos, torch.get_num_threads()))
        for i in range(n):
            caches[i].written(pos[i] + 1)
        return True


# what `runs_natively` is asked about: a CPU tensor of each dtype a norm here takes
_PROBES = {dtype: torch.zeros(1, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}
