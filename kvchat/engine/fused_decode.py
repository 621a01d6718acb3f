"""A decode forward for the common decoder families under quantized weights, with fewer ops per
layer: Llama (SmolLM2, Llama 3.x), Mistral, Qwen2 / 2.5, Qwen3, Phi-3, Gemma 2 and Gemma 3.

A one-token step on CPU is bound by reading the weights only once per-op overhead is gone, and
transformers' eager forward spends about as long in Python and small ops as in the weight
kernels (SmolLM2 int4, 2 threads: ~5 ms of kernels in an ~11 ms step). This forward runs the
same arithmetic with less around it:
- q, k and v are one int4 matmul, and so are gate and up: the packed weights are stacked by
  output row, and either int4 kernel (kvchat's or torch's) computes every output column from
  its own weight row, so each part comes out bitwise as its own layer's would (the fused
  matmul over SmolLM2's q/k/v takes 11 µs against 22 µs for three calls); biases (Qwen2's
  q/k/v) are added to the stacked output, the same additions; Phi-3's fused qkv and gate_up
  layers are one matmul already;
- the norms, rotary embedding, residuals and the attention function are the same operations in
  the same dtypes as transformers' modules, called directly, without module dispatch, keyword
  plumbing or casts that change nothing. What differs between the families is read from the
  modules once: the norm's formula (Llama's `w * norm(x)` or Gemma's `norm(x) * (1 + w)` in
  float32; kvchat's native norm where the modules run it, `layer_ops`, the matmul's bfloat16
  input written by the same call), q / k norms (Qwen3, Gemma 3: one call over q and k together,
  read in place from the qkv output, each head's weight its own), the rotary embedding in one
  native call (torch's arithmetic bit for bit), Gemma's sandwich norms around attention and
  MLP, the activation (SiLU, or the model's own module), partial rotary (Phi-3), a rotary
  table per layer kind (Gemma 3's local and global layers), a sliding window per layer kind
  (the model's own mask functions), Gemma 2's attention logit soft-cap (the attention function
  applies it) and the final logit soft-cap.
The embedding (Gemma's scaled one included), the attention masks and the rotary tables come
from the model's own modules, once per forward. So the logits equal the model's own forward
bitwise (tests check it per family, layer kind and hit kind), and transformers' `generate` over
the same model stays the reference.

It takes forwards of at most `SMALL_Q` queries per row (decode steps, draft verification);
prefill, H2O's tracked forwards and models whose layers it does not know keep the model's
forward. Float models
keep it too: their GEMMs are not column-separable, so stacking weights could round differently.
A batch whose rows share a head (`shares_heads`) is taken only by models without sliding
layers: a window would have to reach into the shared head's columns.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from kvchat.engine import fused_norms
from kvchat.engine.decode_attention import (
    NAME,
    SMALL_Q,
    fixed_attention,
    head_attention,
    small_q_attention,
)
from kvchat.engine.fused_norms import Norm, rms_norm
from kvchat.engine.native_layer import NativeLayer, NativeStack
from kvchat.engine.past import shared_head
from kvchat.models.architectures import DECODER_FAMILIES
from kvchat.models.heap import huge_cat, release_heap
from kvchat.models.layer_ops import rotary as native_rotary
from kvchat.models.native import int4_bound, library
from kvchat.models.quant import Int4Linear, Int8Linear, QuantLinear

_LAYER_CLASSES = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer",
                            "Qwen3DecoderLayer", "Phi3DecoderLayer", "Gemma2DecoderLayer",
                            "Gemma3DecoderLayer"})
# `_convert_weight_to_int4pack_for_cpu` lays rows out in blocks of 64 output rows (a shorter
# tail block when N is not a multiple): packed layers stack by row only when each is whole blocks
_INT4_BLOCK_N = 64
_SILU = frozenset({"SiLUActivation", "SiLU"})
_ATTRIBUTE = "_kvchat_fused_decoder"  # where a model keeps its FusedDecoder (or None)
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default
_FULL, _SLIDING = "full_attention", "sliding_attention"
Matmul = Callable[[torch.Tensor], torch.Tensor]  # (rows, K) bfloat16 -> (rows, N) bfloat16


class _Layer(NamedTuple):
    attn: Any  # the attention module (the attention function reads its settings)
    kind: str  # full_attention or sliding_attention: which mask and rotary table it takes
    qkv: Matmul  # (rows, hidden) -> (rows, q | k | v)
    o: Matmul
    gate_up: Matmul  # (rows, hidden) -> (rows, gate | up)
    down: Matmul
    act: Callable[[torch.Tensor], torch.Tensor]
    norm1: Norm  # before attention
    norm2: Norm  # before the MLP
    post_attn: Norm | None  # Gemma's norms of the attention and MLP outputs
    post_mlp: Norm | None
    qk_norm: Norm | None  # per head over q and k together (Qwen3, Gemma 3)
    heads: int
    kv_heads: int
    head_dim: int
    qk_width: int  # columns of q and k in the qkv output
    intermediate: int  # columns of gate (and of up) in the gate_up output
    scaling: float
    softcap: float | None  # Gemma 2's attention logit soft-cap


def _biased(mm: Matmul, bias: torch.Tensor | None) -> Matmul:
    """QuantLinear's forward around a stacked matmul: the input cast to the kernels' bfloat16
    (a float32 residual stream's norm hands float32), then the bias added over the stacked
    columns."""

    def layer(x: torch.Tensor) -> torch.Tensor:
        out = mm(x.to(torch.bfloat16))
        return out if bias is None else out + bias

    # what `native_layer` runs in C: the int4 kernel's tensors, where it is that kernel
    layer.weights = getattr(mm, "weights", None)  # type: ignore[attr-defined]
    layer.bias = bias  # type: ignore[attr-defined]
    return layer


def _stack(layers: Sequence[QuantLinear]) -> Matmul | None:
    """One matmul for same-input layers where their packing allows (else one call each,
    concatenated), their biases added after it; None when only some have one."""
    biases = [layer.bias for layer in layers]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return None
    bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
    if len(layers) == 1:
        return _biased(_matmul(layers[0]), bias)
    int4 = [layer for layer in layers if isinstance(layer, Int4Linear)]
    if len(int4) == len(layers) and all(layer.native for layer in int4):
        return _biased(_stack_native_int4(int4), bias)
    if len(int4) == len(layers) and all(layer.out_features % _INT4_BLOCK_N == 0
                                        and layer.group == int4[0].group
                                        and not layer.native for layer in int4):
        return _biased(_stack_int4(int4), bias)
    int8 = [layer for layer in layers if isinstance(layer, Int8Linear)]
    if len(int8) == len(layers):
        return _biased(_stack_int8(int8), bias)

    def each(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer._mm(x) for layer in layers], dim=-1)

    return _biased(each, bias)


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


def _stack_native_int4(layers: Sequence[Int4Linear]) -> Matmul:
    """kvchat's int4 kernel computes each output row from its own weight row, scales and zeros
    only, in one order: stacked rows give each layer's own bits."""
    stacked = {name: huge_cat([layer.get_buffer(name) for layer in layers])
               for name in ("qweight", "scales", "zeros")}
    for name, tensor in stacked.items():
        _share_rows(layers, name, tensor)
    return int4_bound(stacked["qweight"], stacked["scales"], stacked["zeros"])


def _matmul(layer: QuantLinear) -> Matmul:
    """A layer's matmul, bound to its weight once where kvchat's int4 kernel runs it."""
    if isinstance(layer, Int4Linear) and layer.native:
        return int4_bound(layer.get_buffer("qweight"), layer.get_buffer("scales"),
                          layer.get_buffer("zeros"))
    return layer._mm


def _stack_int8(layers: Sequence[Int8Linear]) -> Matmul:
    qweight = huge_cat([layer.get_buffer("qweight") for layer in layers])
    row_scales = torch.cat([layer.get_buffer("scales") for layer in layers])
    _share_rows(layers, "qweight", qweight)

    def int8_mm(x: torch.Tensor) -> torch.Tensor:
        return _INT8_MM(x, qweight, row_scales)

    return int8_mm


def _layer_kind(config: Any, index: int) -> str:
    """Which mask a layer takes, as the family's model forward decides it: the config's
    layer_types where it has them (Qwen2/3, Gemma 3), else the sliding window when one is set
    (Mistral, Phi-3), else full attention (Llama)."""
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) > index:
        return str(types[index])
    return _SLIDING if getattr(config, "sliding_window", None) is not None else _FULL


def _projections(layer: Any) -> tuple[list[Any], list[Any]] | None:
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [getattr(attn, "qkv_proj", None)] if hasattr(attn, "qkv_proj") else \
        [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    gate_up = [getattr(mlp, "gate_up_proj", None)] if hasattr(mlp, "gate_up_proj") else \
        [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
    parts = [*qkv, attn.o_proj, *gate_up, mlp.down_proj]
    if not all(isinstance(p, QuantLinear) for p in parts):
        return None
    return qkv, gate_up


def _activation(mlp: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    act = getattr(mlp, "act_fn", None) or mlp.activation_fn
    if type(act).__name__ in _SILU:
        return nn.functional.silu
    forward: Callable[[torch.Tensor], torch.Tensor] = act.forward  # the module's own arithmetic
    return forward


def _layer(layer: Any, config: Any, index: int) -> _Layer | None:
    if type(layer).__name__ not in _LAYER_CLASSES:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    found = _projections(layer)
    if found is None or getattr(config, "pretraining_tp", 1) != 1:
        return None
    if attn.o_proj.bias is not None or mlp.down_proj.bias is not None:
        return None
    qkv_layers, gate_up_layers = found
    norm1, norm2 = fused_norms.norm(layer.input_layernorm), fused_norms.norm(getattr(
        layer, "pre_feedforward_layernorm", layer.post_attention_layernorm))
    sandwich = hasattr(layer, "pre_feedforward_layernorm")
    post_attn = fused_norms.norm(layer.post_attention_layernorm) if sandwich else None
    post_mlp = fused_norms.norm(layer.post_feedforward_layernorm) if sandwich else None
    if norm1 is None or norm2 is None or (sandwich and (post_attn is None or post_mlp is None)):
        return None
    head_dim = int(attn.head_dim)
    heads = int(config.num_attention_heads)
    kv_heads = int(config.num_key_value_heads)
    qk_norm = fused_norms.qk_norm(attn, heads, kv_heads)
    qkv, gate_up = _stack(qkv_layers), _stack(gate_up_layers)
    if qkv is None or gate_up is None or isinstance(qk_norm, bool):
        return None
    width = sum(p.out_features for p in gate_up_layers) // 2
    return _Layer(attn, _layer_kind(config, index), qkv, _matmul(attn.o_proj), gate_up,
                  _matmul(mlp.down_proj), _activation(mlp), norm1, norm2, post_attn, post_mlp,
                  qk_norm, heads, kv_heads, head_dim, (heads + kv_heads) * head_dim,
                  width, float(attn.scaling), getattr(attn, "attn_logit_softcapping", None))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary_pos_emb's arithmetic, elementwise, so q and k can share one call:
    x (B, H, Q, D), cos / sin (B, 1, Q, R); R < D rotates the first R dims only (Phi-3's
    partial rotary), the rest pass through."""
    rotary = cos.shape[-1]
    part = x[..., :rotary] if rotary < x.shape[-1] else x
    half = rotary // 2
    rotated = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
    out = (part * cos) + (rotated * sin)
    return out if rotary == x.shape[-1] else torch.cat([out, x[..., rotary:]], dim=-1)


class FusedDecoder:
    """`FusedDecoder.build(model)`: the fused forward for `model`, or None if it has layers
    this forward does not cover (the caller then keeps the model's own forward)."""

    def __init__(self, model: Any, layers: list[_Layer], norm: Norm) -> None:
        self.decoder = model.get_decoder()
        self.family = DECODER_FAMILIES[type(model).__name__]
        self.layers = layers
        self.norm = norm  # the final one
        self.head = model.get_output_embeddings()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.kinds = sorted({layer.kind for layer in layers})
        self.rotary_native = library() is not None
        rotary = self.decoder.rotary_emb
        self._rotary_per_kind = "layer_type" in inspect.signature(rotary.forward).parameters
        # a shared head's columns carry no window: only models without sliding layers take one
        # (and without an attention soft-cap, which head_attention does not apply)
        self.shares_heads = self.kinds == [_FULL] and all(
            layer.softcap is None for layer in layers)
        width = int(model.config.hidden_size)
        # one row's new token through a layer in one native call, where the layer takes it
        self.native = [NativeLayer.build(layer, width) for layer in layers]
        self.native_layers = sum(layer is not None for layer in self.native)
        # and every layer in one call where every layer runs so
        natives = [layer for layer in self.native if layer is not None]
        self.stack = NativeStack(natives) if natives and len(natives) == len(layers) else None

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
        if decoder is None or config is None or type(model).__name__ not in DECODER_FAMILIES:
            return None
        if str(config._attn_implementation) != NAME:  # use_decode_attention switched it
            return None
        if next(model.parameters()).device.type != "cpu":  # kvchat's kernels are CPU code
            return None
        if getattr(config, "use_bidirectional_attention", False):
            return None
        norm = fused_norms.norm(decoder.norm)
        if not isinstance(model.get_output_embeddings(), QuantLinear) or norm is None:
            return None
        layers = []
        for i, layer in enumerate(decoder.layers):
            layers.append(_layer(layer, config, i))
            # the layer's own weights its stacks replaced went back to the heap (those below
            # glibc's mmap threshold): handed back now, the build's peak holds one layer's
            # copy, not the model's (Qwen2.5 0.5B shape: ~130 MiB)
            release_heap()
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
        masks: dict[str, Any] = {}
        tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for kind in self.kinds:
            make = create_sliding_window_causal_mask if kind == _SLIDING else create_causal_mask
            masks[kind] = make(config=decoder.config, inputs_embeds=hidden,
                               attention_mask=attention_mask, past_key_values=past,
                               position_ids=position_ids)
            if self._rotary_per_kind:
                cos, sin = decoder.rotary_emb(hidden, position_ids, kind)
            elif not tables:
                cos, sin = decoder.rotary_emb(hidden, position_ids=position_ids)
            tables[kind] = (cos, sin)
        cache_layers = past.layers
        hidden = hidden.view(b * q, -1)  # the layers work on (rows, hidden)
        # a native layer adds to its own float32 copy of the stream in place
        one = bool(self.native_layers) and b == 1 and q == 1 \
            and hidden.dtype == torch.float32 and hidden.is_cpu
        if one:
            hidden = hidden.clone(memory_format=torch.contiguous_format)
        stacked = one and self.stack is not None \
            and all(masks[kind] is None for kind in self.kinds) \
            and self.stack.run(hidden, cache_layers, [tables[layer.kind] for layer in self.layers])
        if not stacked:
            for i, layer in enumerate(self.layers):
                cos, sin = tables[layer.kind]
                native = self.native[i] if one and masks[layer.kind] is None else None
                if native is not None and native.run(hidden, cache_layers[i], cos, sin):
                    continue
                hidden = self._layer(layer, hidden, cache_layers[i], masks[layer.kind], cos,
                                     sin, b, q, self.rotary_native)
        hidden = rms_norm(hidden, self.norm).view(b, q, -1)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) \
            else logits_to_keep
        logits = self.head(hidden[:, keep, :])
        if self.softcap is not None:  # the family's own final soft-cap, the same three ops
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @staticmethod
    def _layer(layer: _Layer, hidden: torch.Tensor, cache: Any, mask: Any, cos: torch.Tensor,
               sin: torch.Tensor, b: int, q: int, rotary_native: bool) -> torch.Tensor:
        """One decoder layer over hidden (b * q, width); cos / sin (b or 1, q, rotary dims)."""
        d, heads, qk_width = layer.head_dim, layer.heads, layer.qk_width
        qkv = layer.qkv(rms_norm(hidden, layer.norm1, to_bf16=True))
        qk = qkv[:, :qk_width]
        if layer.qk_norm is not None:
            qk = rms_norm(qk, layer.qk_norm)
        qk = qk.view(b, q, -1, d)
        if rotary_native and qk.dtype == torch.bfloat16 and cos.dtype == torch.bfloat16:
            qk = native_rotary(qk, cos, sin)  # the same arithmetic, one call
        else:
            qk = _rotate(qk.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1))
        value = qkv[:, qk_width:].view(b, q, layer.kv_heads, d).transpose(1, 2)
        key, value = cache.update(qk[:, heads:], value)
        head = shared_head(cache)
        if head is None:  # the fixed-order kernel straight away where it runs
            out = fixed_attention(qk[:, :heads], key, value, mask, layer.scaling, layer.softcap)
            if out is None:
                out, _ = small_q_attention(layer.attn, qk[:, :heads], key, value, mask,
                                           scaling=layer.scaling, softcap=layer.softcap)
        else:  # every row starts with the same K/V, held once
            out = head_attention(qk[:, :heads], head, key, value, mask, layer.scaling)
        attended = layer.o(out.reshape(b * q, -1).contiguous())
        if layer.post_attn is not None:
            attended = rms_norm(attended, layer.post_attn)
        hidden = hidden + attended
        gate_up = layer.gate_up(rms_norm(hidden, layer.norm2, to_bf16=True))
        n = layer.intermediate
        mlp = layer.down(layer.act(gate_up[:, :n]) * gate_up[:, n:])
        if layer.post_mlp is not None:
            mlp = rms_norm(mlp, layer.post_mlp)
        return hidden + mlp
