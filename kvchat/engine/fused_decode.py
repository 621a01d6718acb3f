"""A decode forward for Llama-family layers under quantized weights, with fewer ops per layer.

A one-token step on CPU is bound by reading the weights only once per-op overhead is gone, and
transformers' eager forward spends about as long in Python and small ops as in the weight
kernels (SmolLM2 int4, 2 threads: ~5 ms of kernels in an ~11 ms step). This forward runs the
same arithmetic with less around it:
- q, k and v are one int4 matmul, and so are gate and up: the packed weights are stacked by
  output row, and the kernel computes every output column from its own weight row, so each part
  comes out bitwise as its own layer's would (the fused matmul over SmolLM2's q/k/v takes 11 µs
  against 22 µs for three calls);
- the norms, rotary embedding, residuals and the attention function are the same operations in
  the same dtypes as transformers' modules, called directly, without module dispatch, keyword
  plumbing or casts that change nothing.
The embedding, the attention mask and the rotary tables come from the model's own modules, once
per forward. So the logits equal the model's own forward bitwise (tests check it per layer kind
and hit kind), and transformers' `generate` over the same model stays the reference.

It takes forwards of at most `SMALL_Q` queries per row (decode steps, draft verification);
prefill, H2O's tracked forwards and models whose layers differ from Llama's keep the model's
forward. Float models keep it too: their GEMMs are not column-separable, so stacking weights
could round differently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from kvchat.engine.decode_attention import NAME, SMALL_Q, head_attention, small_q_attention
from kvchat.engine.past import shared_head
from kvchat.models.quant import Int4Linear, Int8Linear, QuantLinear

# decoder layers whose forward is Llama's: pre-norm attention and a SiLU-gated MLP, no biases
_LAYER_CLASSES = frozenset({"LlamaDecoderLayer"})
# `_convert_weight_to_int4pack_for_cpu` lays rows out in blocks of 64 output rows (a shorter
# tail block when N is not a multiple): packed layers stack by row only when each is whole blocks
_INT4_BLOCK_N = 64
_SILU = frozenset({"SiLUActivation", "SiLU"})
_ATTRIBUTE = "_kvchat_fused_decoder"  # where a model keeps its FusedDecoder (or None)
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default
Matmul = Callable[[torch.Tensor], torch.Tensor]  # (rows, K) bfloat16 -> (rows, N) bfloat16


class _Layer(NamedTuple):
    attn: Any  # the attention module (the attention function reads its settings)
    qkv: Matmul  # (rows, hidden) -> (rows, q | k | v)
    o: Matmul
    gate_up: Matmul  # (rows, hidden) -> (rows, gate | up)
    down: Matmul
    norm1: tuple[torch.Tensor, tuple[int], float]
    norm2: tuple[torch.Tensor, tuple[int], float]
    heads: int
    kv_heads: int
    head_dim: int
    qk_width: int  # columns of q and k in the qkv output
    intermediate: int  # columns of gate (and of up) in the gate_up output
    scaling: float


def _stack(layers: Sequence[QuantLinear]) -> Matmul | None:
    """One matmul for same-input layers where their packing allows (else one call each,
    concatenated), or None when they have biases."""
    if any(layer.bias is not None for layer in layers):
        return None
    int4 = [layer for layer in layers if isinstance(layer, Int4Linear)]
    if len(int4) == len(layers) and all(layer.out_features % _INT4_BLOCK_N == 0
                                        and layer.group == int4[0].group for layer in int4):
        return _stack_int4(int4)
    int8 = [layer for layer in layers if isinstance(layer, Int8Linear)]
    if len(int8) == len(layers):
        return _stack_int8(int8)

    def each(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer._mm(x) for layer in layers], dim=-1)

    return each


def _share_rows(layers: Sequence[QuantLinear], name: str, stacked: torch.Tensor) -> None:
    """Point each layer's `name` buffer at its rows of `stacked`, so the weight is held once."""
    start = 0
    for layer in layers:
        setattr(layer, name, stacked[start : start + layer.out_features])
        start += layer.out_features


def _stack_int4(layers: Sequence[Int4Linear]) -> Matmul:
    group = layers[0].group
    packed = torch.cat([layer.get_buffer("packed") for layer in layers], dim=0)
    scales = torch.cat([layer.get_buffer("scales_and_zeros") for layer in layers],
                       dim=1).contiguous()
    _share_rows(layers, "packed", packed)

    def int4_mm(x: torch.Tensor) -> torch.Tensor:
        return _INT4_MM(x, packed, group, scales)

    return int4_mm


def _stack_int8(layers: Sequence[Int8Linear]) -> Matmul:
    qweight = torch.cat([layer.get_buffer("qweight") for layer in layers], dim=0)
    row_scales = torch.cat([layer.get_buffer("scales") for layer in layers])
    _share_rows(layers, "qweight", qweight)

    def int8_mm(x: torch.Tensor) -> torch.Tensor:
        return _INT8_MM(x, qweight, row_scales)

    return int8_mm


def _norm(module: Any) -> tuple[torch.Tensor, tuple[int], float] | None:
    if type(module).__name__ != "LlamaRMSNorm":
        return None
    return module.weight, (int(module.weight.shape[-1]),), float(module.variance_epsilon)


def _layer(layer: Any, config: Any) -> _Layer | None:
    if type(layer).__name__ not in _LAYER_CLASSES:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                   mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if not all(isinstance(p, QuantLinear) for p in projections):
        return None
    if type(mlp.act_fn).__name__ not in _SILU or getattr(config, "pretraining_tp", 1) != 1:
        return None
    norm1, norm2 = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)
    if norm1 is None or norm2 is None or attn.o_proj.bias is not None \
            or mlp.down_proj.bias is not None:
        return None
    qkv = _stack([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up = _stack([mlp.gate_proj, mlp.up_proj])
    if qkv is None or gate_up is None:
        return None
    head_dim = int(attn.head_dim)
    heads, kv_heads = attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim
    return _Layer(attn, qkv, attn.o_proj._mm, gate_up, mlp.down_proj._mm, norm1, norm2,
                  heads, kv_heads, head_dim, (heads + kv_heads) * head_dim,
                  mlp.gate_proj.out_features, float(attn.scaling))


def _rms_norm(x: torch.Tensor, norm: tuple[torch.Tensor, tuple[int], float]) -> torch.Tensor:
    """LlamaRMSNorm: float32 x * rsqrt(mean(x^2) + eps), cast back, times the weight
    (`torch.rms_norm` runs the same arithmetic in one call)."""
    weight, shape, eps = norm
    return weight * torch.rms_norm(x.float(), shape, eps=eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary_pos_emb's arithmetic, elementwise, so q and k can share one call:
    x (B, H, Q, D), cos / sin (B, 1, Q, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


class FusedDecoder:
    """`FusedDecoder.build(model)`: the fused forward for `model`, or None if it has layers
    this forward does not cover (the caller then keeps the model's own forward)."""

    def __init__(self, model: Any, layers: list[_Layer],
                 norm: tuple[torch.Tensor, tuple[int], float]) -> None:
        self.decoder = model.get_decoder()
        self.layers = layers
        self.norm = norm  # the final one
        self.head = model.get_output_embeddings()

    @classmethod
    def build(cls, model: Any) -> FusedDecoder | None:
        """Built once per model (runners over one model share it and its stacked weights)."""
        built = model.__dict__.get(_ATTRIBUTE, False)
        if built is False:
            built = cls._build(model)
            model.__dict__[_ATTRIBUTE] = built
        return built

    @classmethod
    def _build(cls, model: Any) -> FusedDecoder | None:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        config = getattr(model, "config", None)
        if decoder is None or config is None or type(model).__name__ != "LlamaForCausalLM":
            return None
        if str(config._attn_implementation) != NAME:  # use_decode_attention switched it
            return None
        norm = _norm(decoder.norm)
        if not isinstance(model.get_output_embeddings(), QuantLinear) or norm is None:
            return None
        layers = [_layer(layer, config) for layer in decoder.layers]
        if not layers or any(layer is None for layer in layers):
            return None
        return cls(model, [layer for layer in layers if layer is not None], norm)

    def takes(self, input_ids: torch.Tensor) -> bool:
        return input_ids.shape[1] <= SMALL_Q

    def forward(
        self,
        input_ids: torch.Tensor,
        past: Any,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        logits_to_keep: int | torch.Tensor,
    ) -> torch.Tensor:
        """The model's forward(input_ids, attention_mask, position_ids, past, use_cache=True,
        logits_to_keep).logits, `past` growing in place the same way."""
        decoder = self.decoder
        hidden = decoder.embed_tokens(input_ids)
        b, q = input_ids.shape
        if position_ids is None:
            position_ids = (torch.arange(q, device=hidden.device)
                            + past.get_seq_length()).unsqueeze(0)
        mask = create_causal_mask(config=decoder.config, inputs_embeds=hidden,
                                  attention_mask=attention_mask, past_key_values=past,
                                  position_ids=position_ids)
        cos, sin = decoder.rotary_emb(hidden, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        cache_layers = past.layers
        hidden = hidden.view(b * q, -1)  # the layers work on (rows, hidden)
        for i, layer in enumerate(self.layers):
            hidden = self._layer(layer, hidden, cache_layers[i], mask, cos, sin, b, q)
        hidden = _rms_norm(hidden, self.norm).view(b, q, -1)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) \
            else logits_to_keep
        return self.head(hidden[:, keep, :])

    @staticmethod
    def _layer(layer: _Layer, hidden: torch.Tensor, cache: Any, mask: Any, cos: torch.Tensor,
               sin: torch.Tensor, b: int, q: int) -> torch.Tensor:
        """One decoder layer over hidden (b * q, width)."""
        d, heads, qk_width = layer.head_dim, layer.heads, layer.qk_width
        qkv = layer.qkv(_rms_norm(hidden, layer.norm1))
        qk = _rotate(qkv[:, :qk_width].view(b, q, -1, d).transpose(1, 2), cos, sin)
        value = qkv[:, qk_width:].view(b, q, layer.kv_heads, d).transpose(1, 2)
        key, value = cache.update(qk[:, heads:], value)
        head = shared_head(cache)
        if head is None:
            out, _ = small_q_attention(layer.attn, qk[:, :heads], key, value, mask,
                                       scaling=layer.scaling)
        else:  # every row starts with the same K/V, held once
            out = head_attention(qk[:, :heads], head, key, value, mask, layer.scaling)
        hidden = hidden + layer.o(out.reshape(b * q, -1).contiguous())
        gate_up = layer.gate_up(_rms_norm(hidden, layer.norm2))
        n = layer.intermediate
        return hidden + layer.down(nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:])
