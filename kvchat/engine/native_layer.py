"""A decoder layer in one native call (models/decode_layer.c): the fused decode forward's
commonest step, one row and one new token through a Llama-shaped layer (RMSNorms on kvchat's
native norm, int4 weights on kvchat's kernel, SiLU, full attention over a reserved one-row
cache), without the dozen Python calls between kernels that `fused_decode._layer` makes. The C
runs that method's kernels in its order and rounds as torch does between them (SiLU is torch's
own, a table of every bfloat16 value), so a sequence gets the same bits either way; a test
holds the two to it. Anything else, or any check that fails, runs `_layer`."""

from __future__ import annotations

import ctypes
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


class _LayerArgs(ctypes.Structure):  # decode_layer.c's layer_t
    _fields_ = [("norm1", _void), ("norm2", _void), ("eps1", _float), ("eps2", _float),
                ("flags1", _int), ("flags2", _int), ("qkv", _Int4), ("o", _Int4),
                ("gate_up", _Int4), ("down", _Int4), ("hidden", _long), ("heads", _long),
                ("kv_heads", _long), ("dim", _long), ("rotary", _long), ("inter", _long),
                ("scaling", _float), ("silu", _void)]


@cache
def silu_table() -> torch.Tensor:
    """torch's bfloat16 SiLU of every bfloat16, indexed by its bits: (65536,) int16."""
    signed = torch.arange(-32768, 32768, dtype=torch.int16)
    values = torch.cat([signed[32768:], signed[:32768]]).view(torch.bfloat16)  # 0x0000 ...
    # in pieces of whole vectors below torch's thread split: each value in a loop's body
    return torch.cat([nn.functional.silu(values[i : i + 4096])
                      for i in range(0, 65536, 4096)]).view(torch.int16).contiguous()


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

    def __init__(self, args: _LayerArgs, norms: tuple[Norm, Norm], keep: tuple[Any, ...]) -> None:
        self.args = args
        self.norms = norms
        self.held: list[NormWeight | None] = [None, None]
        self.keep = keep  # the tensors args points into
        self.kernel = library().kvchat_decode_layer  # type: ignore[union-attr]
        self.address = ctypes.addressof(args)

    @classmethod
    def build(cls, layer: Any, hidden: int) -> NativeLayer | None:
        lib = library()
        d, heads, kv_heads, inter = layer.head_dim, layer.heads, layer.kv_heads, layer.intermediate
        if (lib is None or layer.qk_norm is not None or layer.post_attn is not None
                or layer.post_mlp is not None or layer.softcap is not None
                or layer.kind != "full_attention" or layer.act is not nn.functional.silu
                or not (layer.norm1.native and layer.norm2.native)
                or layer.norm1.heads is not None or layer.norm2.heads is not None
                or inter % _VECTOR or inter >= _GRAIN):
            return None
        parts = (_int4(layer.qkv, (heads + 2 * kv_heads) * d, hidden),
                 _int4(layer.o, hidden, heads * d), _int4(layer.gate_up, 2 * inter, hidden),
                 _int4(layer.down, hidden, inter))
        if any(part is None for part in parts):
            return None
        table = silu_table()
        args = _LayerArgs(None, None, 0.0, 0.0, 0, 0, *parts, hidden, heads, kv_heads, d, d,
                          inter, layer.scaling, table.data_ptr())
        keep = (table, layer.qkv, layer.o, layer.gate_up, layer.down)
        return cls(args, (layer.norm1, layer.norm2), keep)

    def _norms_ready(self, hidden: torch.Tensor) -> bool:
        """The norms' weights as the modules hold them now, in args (taken again when a module
        was given another weight)."""
        for i, norm in enumerate(self.norms):
            weights = norm.weights()
            if weights is self.held[i]:
                continue
            bf16 = torch.bfloat16
            if not runs_natively(hidden, weights, bf16) or not weights.weight.is_contiguous():
                return False
            flags = norm_flags(hidden.dtype, weights.weight.dtype, weights.gemma, bf16)
            if i == 0:
                self.args.norm1, self.args.eps1, self.args.flags1 = \
                    weights.weight.data_ptr(), weights.eps, flags
            else:
                self.args.norm2, self.args.eps2, self.args.flags2 = \
                    weights.weight.data_ptr(), weights.eps, flags
            self.held[i] = weights
        return True

    def run(self, hidden: torch.Tensor, cache: Any, cos: torch.Tensor, sin: torch.Tensor
            ) -> bool:
        """The layer over `hidden` ((1, width) float32, updated in place) and its cache layer,
        the new token's K/V written at its position; False (nothing done) where it does not
        run here."""
        if type(cache) is not _ReservedLayer or cache.head is not None:
            return False
        k_buf, v_buf = cache._k, cache._v
        pos, capacity = cache._len, k_buf.shape[2]
        if (k_buf.shape[0] != 1 or pos >= capacity or k_buf.dtype != torch.bfloat16
                or v_buf.dtype != torch.bfloat16 or not k_buf.is_contiguous()
                or not v_buf.is_contiguous() or cos.shape[-1] != self.args.dim
                or cos.dtype != torch.bfloat16 or sin.dtype != torch.bfloat16
                or not cos.is_contiguous() or not sin.is_contiguous()
                or not self._norms_ready(hidden)):
            return False
        rc = self.kernel(self.address, hidden.data_ptr(), cos.data_ptr(),
                         sin.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), capacity, pos,
                         torch.get_num_threads())
        if rc == -2:
            raise MemoryError("decode layer: no memory for its activations")
        if rc != 0:
            raise ValueError("decode layer: the kernels refused its shapes")
        cache.written(pos + 1)
        return True
