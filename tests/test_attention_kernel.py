"""attention.c, the fixed-order attention every CPU forward runs: the float definition, and the
same bits per query whatever else is in the call (padding, holes, other queries, a shared head,
threads, instruction set)."""

from __future__ import annotations

import pytest
import torch

from kvchat.models import native

pytestmark = pytest.mark.skipif(not native.attention_native(), reason="no native library here")


def _qkv(b: int, heads: int, kv_heads: int, n_q: int, n_k: int, dim: int, dtype: torch.dtype,
         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, heads, n_q, dim, generator=g).to(dtype),
            torch.randn(b, kv_heads, n_k, dim, generator=g).to(dtype),
            torch.randn(b, kv_heads, n_k, dim, generator=g).to(dtype))


def _definition(q, k, v, mask, scale, softcap=None):
    """float64 softmax(scale q k^T) v over the visible keys, (B, Q, H, D)."""
    groups = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(groups, 1)
    v64 = v.double().repeat_interleave(groups, 1)
    s = q.double() @ k64.transpose(2, 3) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if mask is None:
        n_q, n_k = q.shape[2], k.shape[2]
        mask = (torch.arange(n_k)[None] <= torch.arange(n_q)[:, None] + n_k - n_q)[None]
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return (s.softmax(-1) @ v64).transpose(1, 2)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("dim", [64, 72])  # 72: dims past the last 16 take the tail path
def test_it_computes_attention(dtype, atol, dim):
    q, k, v = _qkv(2, 6, 2, 5, 40, dim, dtype)
    for mask in (None, torch.rand(2, 5, 40, generator=torch.Generator().manual_seed(3)) > 0.4):
        out = native.attention(q, k, v, mask, 0.125)
        assert out.dtype == dtype and out.shape == (2, 5, 6, dim)
        want = _definition(q, k, v, mask, 0.125)
        assert float((out.double() - want).abs().max()) < atol
    capped = native.attention(q, k, v, None, 0.5, softcap=3.0)
    assert float((capped.double() - _definition(q, k, v, None, 0.5, 3.0)).abs().max()) < atol


def test_a_query_that_sees_no_key_gets_zeros():
    q, k, v = _qkv(1, 2, 1, 2, 6, 16, torch.bfloat16)
    mask = torch.zeros(1, 2, 6, dtype=torch.bool)
    mask[0, 1, 2] = True
    out = native.attention(q, k, v, mask, 0.25)
    assert not out[0, 0].any() and torch.equal(out[0, 1, 0], v[0, 0, 2])


def test_a_query_has_the_same_bits_whatever_else_is_in_the_call():
    q, k, v = _qkv(1, 9, 3, 6, 50, 64, torch.bfloat16)
    alone = [native.attention(q[:, :, i : i + 1], k[:, :, : 45 + i], v[:, :, : 45 + i], None,
                              0.125) for i in range(6)]
    together = native.attention(q, k, v, None, 0.125)  # causal: query i sees 45 + i keys
    for i in range(6):
        assert torch.equal(together[:, i : i + 1], alone[i])
    # left padding, holes and a second row of other keys beside it
    pad = _qkv(1, 9, 3, 6, 11, 64, torch.bfloat16, seed=1)[1:]
    k2, v2 = (torch.cat([p, t, p[:, :, :4]], 2) for p, t in zip(pad, (k, v), strict=True))
    kk = torch.cat([k2, torch.randn_like(k2)])
    vv = torch.cat([v2, torch.randn_like(v2)])
    qq = torch.cat([q, torch.randn_like(q)])
    mask = torch.zeros(2, 6, kk.shape[2], dtype=torch.bool)
    for i in range(6):
        mask[0, i, 11 : 11 + 45 + i] = True
    mask[1] = torch.rand(6, kk.shape[2]) > 0.5
    padded = native.attention(qq, kk, vv, mask, 0.125)
    assert torch.equal(padded[:1], together)
    # a head held once: the first 30 positions beside the rows' own
    head = (k[:, :, :30].contiguous(), v[:, :, :30].contiguous())
    split = native.attention(q, k[:, :, 30:], v[:, :, 30:], None, 0.125, head=head)
    assert torch.equal(split, together)


def test_threads_and_instruction_sets_give_the_same_bits():
    q, k, v = _qkv(3, 8, 2, 7, 300, 128, torch.bfloat16)
    mask = torch.rand(3, 7, 300, generator=torch.Generator().manual_seed(5)) > 0.2
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(native.attention(q, k, v, mask, 0.1))
    finally:
        torch.set_num_threads(threads)
    for isa in range(native.attention_isa() + 1):  # the baseline, AVX2, AVX-512 as present
        outs.append(native.attention(q, k, v, mask, 0.1, isa=isa))
    portable = native.attention(q, k, v, mask, 0.1, isa=0)
    assert all(torch.equal(o, portable) for o in outs)


def test_strided_keys_read_in_place():
    q, k, v = _qkv(2, 4, 2, 1, 64, 32, torch.float32)
    wide = (torch.cat([k, k], 2), torch.cat([v, v], 2))  # a reserved buffer, 40 columns used
    got = native.attention(q, wide[0][:, :, :40], wide[1][:, :, :40], None, 0.2)
    assert torch.equal(got, native.attention(q, k[:, :, :40].contiguous(),
                                             v[:, :, :40].contiguous(), None, 0.2))
