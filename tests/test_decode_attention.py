"""One query's attention on a CPU: computed in float32 over 16-bit K/V, the same for a decode
step and for each query of a verified draft."""

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


def test_one_bfloat16_query_is_computed_in_float32():
    q, k, v = _qkv(1, 190, torch.bfloat16)
    out, _ = one_query(_Attn(), q, k, v, None, None)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, want.transpose(1, 2).to(torch.bfloat16))


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
