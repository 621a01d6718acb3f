"""Attention for a few queries over a long past: decode steps and draft verification.

torch's fused SDPA kernel on CPU splits its work by query block, so a few queries per row leave
it scanning the keys serially. Two batched matmuls do better on a batch: SmolLM2 (int4, 2
threads) decoding 16 rows took 54 ms per step over 1,000 keys this way against 69 ms with SDPA
(36 vs 39 ms over 200 keys). For one row SDPA is as fast or faster (9.6 vs 10.8 ms per step at
60 keys, 13.6 vs 13.8 at 1,000; 16.1 vs 14.7 at 2,000) and computes its scores in float32 (the
matmuls round them to bfloat16), and `generate` over the same model runs it too (through
`one_query`), so a lone sequence decodes bitwise as `generate` does. Forwards of several rows
with at most `SMALL_Q` queries each therefore take the matmul path; one row, and longer
forwards (prefill), keep the model's own kernel. Registered once per process under `NAME`;
`use_decode_attention(model)` switches a model whose attention is SDPA to it.

One row of a few queries (a draft being verified, a short prompt tail) runs SDPA once per
query, over the keys that query may see, exactly as a one-token decode step at that position
would: the fused kernel rounds a query's output differently when other queries share its call,
and under bfloat16 that is enough to change a greedy token now and then. So verifying a draft
yields bitwise the logits decoding one token at a time would have (the packed linear layers
compute each row on its own too), at ~20 µs per extra query and layer.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

NAME = "kvchat_decode"
SMALL_Q = 16
# keyword arguments only the fused kernel (or eager) knows how to apply
_FUSED_ONLY = ("softcap", "s_aux", "sinks", "position_bias")


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
    """Matmul attention for several rows of at most SMALL_Q queries, else (or for features it
    lacks) SDPA.
    query (B, H, Q, D), key / value (B, KH, K, D); the mask is SDPA's (B, 1, Q, K) boolean
    (True: attend) or additive float, or None (no padding: causal, bottom-right aligned)."""
    n_queries = query.shape[2]
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
    over those columns only). Every row's queries meet the head in one matmul per KV head, as
    one tall matrix, instead of a small matmul per row over its own copy of it; the softmax runs
    over head and own scores together, as over one row's keys. Returns (B, Q, H, D)."""
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


def use_decode_attention(model: Any) -> bool:
    """Switch a model that attends with SDPA to `small_q_attention`; True if it now does.
    Models with their own attention code (or eager attention) are left as they are."""
    if getattr(model, "_supports_attention_backend", True) is False:
        return False
    current = str(model.config._attn_implementation or "")
    if current == NAME:
        return True
    if current != "sdpa":
        return False
    _register()
    model.set_attn_implementation(NAME)
    return True
