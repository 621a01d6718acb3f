"""Attention for every forward kvchat runs on a model: prefill, decode steps, drafts, shared heads.

Where kvchat's native library is built (`native.attention_native`), every call on CPU tensors
of bfloat16 or float32 goes to its fixed-order kernel (attention.c): each query visits the keys
it may see in position order and sums them in one order that depends on those keys only. So a
sequence's attention is bitwise the same whatever else is in the call: its batch row, left
padding, holes left by rejected drafts, draft columns beside it, a shared head held once, the
chunk its prompt was prefilled in, the number of threads. transformers' own `generate` over the
same model runs it too (the model's attention implementation is `NAME`), so a lone cold run and
`generate` agree bitwise. The kernel computes scores, softmax and the weighted sum in float32 and
rounds each output once.

Without the library (KVCHAT_NATIVE=0, no C compiler, GPU tensors), the earlier kernels stay:
SDPA for one row and for prefill, two batched matmuls for several rows of at most `SMALL_Q`
queries, one SDPA call per query for one row's draft; their bits depend on the batch. Features
the kernel lacks (dropout, attention sinks, position biases, per-head masks) keep SDPA too.
Registered once per process under `NAME`; `use_decode_attention(model)` switches a model whose
attention is SDPA to it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvchat.models import native

NAME = "kvchat_decode"
SMALL_Q = 16
# keyword arguments only the fused kernel (or eager) knows how to apply
_FUSED_ONLY = ("softcap", "s_aux", "sinks", "position_bias")
_NATIVE_LACKS = ("s_aux", "sinks", "position_bias")
_NATIVE = (torch.bfloat16, torch.float32)  # the dtypes the native kernel takes


def fixed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    head: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """attention.c's fixed-order attention, (B, Q, H, D), or None where it cannot run (no
    library, not CPU, another dtype, a mask per head or of other values than keep / drop).
    The mask is SDPA's: (B or 1, 1, Q, >= K) boolean (True: attend) or None (causal,
    bottom-right aligned)."""
    if not query.is_cpu or query.dtype not in _NATIVE or not native.attention_native():
        return None
    if attention_mask is not None and (attention_mask.dtype != torch.bool
                                       or attention_mask.shape[1] != 1):
        return None
    mask = None if attention_mask is None else attention_mask[:, 0, :, : key.shape[2]]
    if query.stride(-1) != 1:  # each apart: a generator over three costs a microsecond a call
        query = query.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    return native.attention(query, key, value, mask, scaling, softcap, head)


def small_q_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The fixed-order kernel where it runs (see the module doc); else matmul attention for
    several rows of at most SMALL_Q queries, and SDPA for the rest (and for features neither
    has).
    query (B, H, Q, D), key / value (B, KH, K, D); the mask is SDPA's (B, 1, Q, K) boolean
    (True: attend) or additive float, or None (no padding: causal, bottom-right aligned)."""
    n_queries = query.shape[2]
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True)) is not False
    if not dropout and not any(kwargs.get(k) is not None for k in _NATIVE_LACKS) \
            and (attention_mask is not None or causal or n_queries == 1):
        fixed = fixed_attention(query, key, value, attention_mask,
                                scaling if scaling is not None else query.shape[-1] ** -0.5,
                                kwargs.get("softcap"))
        if fixed is not None:
            return fixed, None
    if kwargs.get("softcap") is not None and not dropout \
            and not any(kwargs.get(k) is not None for k in _NATIVE_LACKS):
        return _softcapped(query, key, value, attention_mask,
                           scaling if scaling is not None else query.shape[-1] ** -0.5,
                           float(kwargs["softcap"])), None
    if n_queries > SMALL_Q or dropout or any(kwargs.get(k) is not None for k in _FUSED_ONLY):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    if query.shape[0] == 1 and n_queries == 1:
        return one_query(module, query, key, value, attention_mask, scaling, **kwargs)
    if query.shape[0] == 1:
        return _one_query_at_a_time(module, query, key, value, attention_mask, scaling, **kwargs)
    b, heads, _, dim = query.shape
    kv_heads, n_keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    # the query heads that share a KV head, stacked as rows: (B, KH, groups * Q, D)
    q = query.reshape(b, kv_heads, groups * n_queries, dim)
    scores = torch.matmul(q, key.transpose(2, 3)) * scale  # (B, KH, groups * Q, K)
    scores = _masked(scores.view(b, kv_heads, groups, n_queries, n_keys), attention_mask)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs.view(b, kv_heads, groups * n_queries, n_keys), value)
    return out.view(b, heads, n_queries, dim).transpose(1, 2).contiguous(), None  # (B, Q, H, D)


def _softcapped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, scaling: float,
                softcap: float) -> torch.Tensor:
    """Attention with a logit soft-cap (Gemma 2: softcap * tanh(s / softcap) before the mask),
    as the family's eager attention computes it, where the fixed-order kernel cannot run:
    SDPA has no soft-cap. (B, Q, H, D)."""
    b, heads, n_queries, dim = query.shape
    kv_heads, n_keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scores = torch.matmul(query, key.repeat_interleave(groups, dim=1).transpose(2, 3)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    scores = _masked(scores.view(b, kv_heads, groups, n_queries, n_keys), attention_mask)
    probs = torch.softmax(scores.view(b, heads, n_queries, n_keys), dim=-1, dtype=torch.float32)
    probs = probs.nan_to_num_(0.0).to(value.dtype)  # a query that sees no key: zeros, as the kernel
    return torch.matmul(probs, value.repeat_interleave(groups, dim=1)).transpose(1, 2) \
        .contiguous()


def _masked(scores: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """scores (B, KH, groups, Q, K) under SDPA's (B, 1, Q, K) mask (boolean, True: attend, or
    additive), or with none, bottom-right causal: query i sees keys up to K - Q + i."""
    n_queries, n_keys = scores.shape[-2:]
    if attention_mask is not None:
        mask = attention_mask[:, :, None, :, :n_keys]  # (B, 1, 1, Q, K)
        if mask.dtype == torch.bool:
            return torch.where(mask, scores, float("-inf"))
        return scores + mask
    if n_queries > 1:
        rows = torch.arange(n_queries, device=scores.device)[:, None]
        cols = torch.arange(n_keys, device=scores.device)[None, :]
        return scores.masked_fill(cols > rows + (n_keys - n_queries), float("-inf"))
    return scores


def head_attention(
    query: torch.Tensor,
    head: tuple[torch.Tensor, torch.Tensor],
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """`small_q_attention` for a batch whose rows all start with the same K/V (`head`, per
    layer (1, KH, P, D), held once) and then have their own (key / value (B, KH, C, D), the mask
    over those columns only). The fixed-order kernel reads the head before each row's own keys,
    as it reads one row's keys; without it, every row's queries meet the head in one matmul per
    KV head, as one tall matrix, and the softmax runs over head and own scores together.
    Returns (B, Q, H, D)."""
    fixed = fixed_attention(query, key, value, attention_mask, scaling, head=head)
    if fixed is not None:
        return fixed
    head_k, head_v = head
    b, heads, n_queries, dim = query.shape
    kv_heads, n_own, n_head = key.shape[1], key.shape[2], head_k.shape[2]
    rows = heads // kv_heads * n_queries  # the query rows that share a KV head, per batch row
    q = query.reshape(b, kv_heads, rows, dim)
    # (KH, B * rows, P): every batch row's queries against the one head
    tall = q.transpose(0, 1).reshape(kv_heads, b * rows, dim)
    s_head = torch.matmul(tall, head_k[0].transpose(1, 2)) * scaling
    s_own = torch.matmul(q, key.transpose(2, 3)) * scaling  # (B, KH, rows, C)
    s_own = _masked(s_own.view(b, kv_heads, -1, n_queries, n_own), attention_mask) \
        .view(b, kv_heads, rows, n_own)
    scores = torch.cat([s_head.view(kv_heads, b, rows, n_head).transpose(0, 1), s_own], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    p_head = probs[..., :n_head].transpose(0, 1).reshape(kv_heads, b * rows, n_head)
    out = torch.matmul(p_head, head_v[0]).view(kv_heads, b, rows, dim).transpose(0, 1) \
        + torch.matmul(probs[..., n_head:], value)  # (B, KH, rows, D)
    return out.reshape(b, heads, n_queries, dim).transpose(1, 2).contiguous()


def one_query(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One row's one query: SDPA with the query heads that share a KV head stacked as rows.

    transformers does that stacking only when a mask is given; with none it asks SDPA for
    grouped-query attention, which on a CPU without bfloat16 arithmetic is several times slower
    in bfloat16 (SmolLM2's 9 query / 3 KV heads, 2 threads: 90 vs 20 µs a layer over 190 keys,
    285 vs 48 over 600; casting to float32 instead costs 29 and 64). Every one-query call (a
    decode step, transformers' `generate` on the same model, each query of a draft being
    verified) comes here, so they stay bitwise alike. float32 keeps transformers' own path."""
    if query.dtype == torch.float32 or any(kwargs.get(k) is not None for k in _FUSED_ONLY):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, **kwargs)
    b, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    mask = attention_mask
    if mask is not None and mask.shape[1] != 1:  # a mask per head
        mask = mask.reshape(b, kv_heads, heads // kv_heads, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(b, kv_heads, heads // kv_heads, dim), key, value, attn_mask=mask,
        scale=scaling)
    return out.reshape(b, heads, 1, dim).transpose(1, 2), None


def _one_query_at_a_time(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One row's Q queries (the last Q positions of its K keys), each in its own SDPA call over
    the keys it sees, with the mask a decode step there gets (None when nothing is masked)."""
    n_queries, n_keys = query.shape[2], key.shape[2]
    outs = []
    for i in range(n_queries):
        seen = n_keys - n_queries + i + 1
        mask = None
        if attention_mask is not None:
            mask = attention_mask[:, :, i : i + 1, :seen]
            if bool((mask if mask.dtype == torch.bool else mask == 0).all()):
                mask = None
        out, _ = one_query(module, query[:, :, i : i + 1], key[:, :, :seen],
                           value[:, :, :seen], mask, scaling, **kwargs)
        outs.append(out)  # (1, 1, H, D)
    return torch.cat(outs, dim=1), None  # (1, Q, H, D)


def _register() -> None:
    if NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(NAME, small_q_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


# families whose attention is eager only because SDPA has no logit soft-cap: the fixed-order
# kernel applies it (and `_softcapped` where the kernel cannot run)
_EAGER_FOR_SOFTCAP = frozenset({"Gemma2ForCausalLM"})


def use_decode_attention(model: Any) -> bool:
    """Switch a model that attends with SDPA (or Gemma 2's eager attention, there for its
    soft-cap) to `small_q_attention`; True if it now does. Models with their own attention
    code (or eager attention) are left as they are."""
    if getattr(model, "_supports_attention_backend", True) is False:
        return False
    current = str(model.config._attn_implementation or "")
    if current == NAME:
        return True
    if current != "sdpa" and not (current == "eager"
                                  and type(model).__name__ in _EAGER_FOR_SOFTCAP):
        return False
    _register()
    model.set_attn_implementation(NAME)
    return True
