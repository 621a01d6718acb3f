"""One query's attention: the query heads that share a KV head stacked as rows of one SDPA call,
in the K/V's own dtype, the same for a decode step and for each query of a verified draft."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvchat.engine.decode_attention import one_query, small_q_attention


class _Attn(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 3


def _qkv(n_queries: int, n_keys: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, n_queries, 64, generator=g).to(dtype)
    k = torch.randn(1, 3, n_keys, 64, generator=g).to(dtype)
    v = torch.randn(1, 3, n_keys, 64, generator=g).to(dtype)
    return q, k, v


def _stacked(q, k, v, mask=None):
    b, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(b, kv_heads, heads // kv_heads, dim), k, v,
                                         attn_mask=mask)
    return out.reshape(b, heads, 1, dim).transpose(1, 2)


def test_one_bfloat16_query_stacks_the_heads_that_share_a_kv_head():
    q, k, v = _qkv(1, 190, torch.bfloat16)
    out, _ = one_query(_Attn(), q, k, v, None, None)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 1, 9, 64)
    assert torch.equal(out, _stacked(q, k, v))
    grouped = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    assert torch.allclose(out.float(), grouped.transpose(1, 2), atol=2e-2)


def test_a_masked_query_sees_only_its_columns():
    q, k, v = _qkv(1, 60, torch.bfloat16)
    mask = torch.ones(1, 1, 1, 60, dtype=torch.bool)
    mask[..., 10:20] = False
    out, _ = one_query(_Attn(), q, k, v, mask, None)
    keep = torch.cat([torch.arange(10), torch.arange(20, 60)])
    unmasked, _ = one_query(_Attn(), q, k[:, :, keep], v[:, :, keep], None, None)
    assert torch.allclose(out.float(), unmasked.float(), atol=1e-2)
    per_head, _ = one_query(_Attn(), q, k, v, mask.expand(1, 9, 1, 60), None)
    assert torch.equal(per_head, out)


def test_float32_queries_are_left_to_the_kernel_as_they_are():
    q, k, v = _qkv(1, 50, torch.float32)
    out, _ = one_query(_Attn(), q, k, v, None, None)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert torch.equal(out, want.transpose(1, 2))


def test_a_drafts_queries_match_one_token_steps_bitwise():
    q, k, v = _qkv(4, 120, torch.bfloat16)
    together, _ = small_q_attention(_Attn(), q, k, v, None)
    for i in range(4):
        seen = 120 - 4 + i + 1
        step, _ = small_q_attention(_Attn(), q[:, :, i:i + 1], k[:, :, :seen], v[:, :, :seen], None)
        assert torch.equal(together[:, i:i + 1], step)


def _head_and_own(b: int, n_queries: int, n_head: int, n_own: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, 9, n_queries, 64, generator=g).to(dtype)
    head = (torch.randn(1, 3, n_head, 64, generator=g).to(dtype),
            torch.randn(1, 3, n_head, 64, generator=g).to(dtype))
    k = torch.randn(b, 3, n_own, 64, generator=g).to(dtype)
    v = torch.randn(b, 3, n_own, 64, generator=g).to(dtype)
    return q, head, k, v


def test_a_head_held_once_attends_as_if_every_row_had_its_own_copy():
    """head_attention over (head, own columns) equals the batch attention over each row's head
    copy then its own columns, with the mask over own columns only (padding, a hole, drafts'
    causal order), and with no mask (several queries: bottom-right causal)."""
    from kvchat.engine.decode_attention import head_attention

    b, n_head, n_own, scale = 3, 70, 12, 64**-0.5
    for n_queries in (1, 4):
        q, head, k, v = _head_and_own(b, n_queries, n_head, n_own, torch.float32)
        full_k = torch.cat([head[0].expand(b, -1, -1, -1), k], dim=2)
        full_v = torch.cat([head[1].expand(b, -1, -1, -1), v], dim=2)
        own = torch.ones(b, 1, n_queries, n_own, dtype=torch.bool).tril(n_own - n_queries)
        own[0, :, :, :5] = False  # row 0 left-padded
        own[1, :, :, 3] = False  # a rejected draft's hole in row 1
        for mask in (own, None):
            got = head_attention(q, head, k, v, mask, scale)
            full_mask = None if mask is None else torch.cat(
                [torch.ones(b, 1, n_queries, n_head, dtype=torch.bool), mask], dim=-1)
            if full_mask is None and n_queries > 1:
                full_mask = torch.ones(b, 1, n_queries, n_head + n_own,
                                       dtype=torch.bool).tril(n_head + n_own - n_queries)
            want, _ = small_q_attention(_Attn(), q, full_k, full_v, full_mask, scaling=scale)
            assert got.shape == (b, n_queries, 9, 64)
            assert torch.allclose(got, want, atol=1e-5), (n_queries, mask is None)
    q, head, k, v = _head_and_own(b, 1, n_head, n_own, torch.bfloat16)
    got = head_attention(q, head, k, v, None, scale)
    assert got.dtype == torch.bfloat16
