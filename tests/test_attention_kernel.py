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


def _exp_cephes(x: float) -> float:
    """attention.c's exp16 for one value, op for op in float32."""
    import numpy as np

    f = np.float32
    small = f(x) < f(-87.0)  # zero below -87, as the kernel masks it
    x = f(-87.0) if small else f(x)
    t = x * f(1.44269504) + f(12582912.0)
    n = t - f(12582912.0)
    r = (x - n * f(0.693359375)) - n * f(-2.12194440e-4)
    poly = f(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
              5.0000001201e-1):
        poly = poly * r + f(c)
    y = poly * r * r + r + f(1.0)
    pow2 = ((np.array(t).view(np.int32) - np.array(f(12582912.0)).view(np.int32) + 127) << 23)
    out = y * np.array(pow2, np.int32).view(np.float32)
    return f(0.0) if small else f(out)


@pytest.mark.parametrize("dim,dtype", [(48, torch.float32), (64, torch.float32),
                                       (64, torch.bfloat16), (96, torch.bfloat16),
                                       (256, torch.bfloat16)])
def test_its_bits_are_the_documented_order_of_sums(dim, dtype):
    """One query against 37 keys, computed here in numpy float32 in the order the source's
    header states (16 lanes over d, the fixed tree, Cephes' exp, the sum in 16 lanes by key,
    the weighted values in key order): the kernel's bits, on every instruction set, alone, as
    the last of 16 queries (a prefill: bfloat16 tensors are then widened once per call) and
    with its first keys in a shared head. Head dims 64, 96, 128 and 256 run the blocked form
    (attention_blocked.c) on AVX-512 and AVX2, 48 and the baseline build the plain one. A
    rewrite of the kernel that kept its tests' other checks but moved one sum fails here."""
    import numpy as np

    f = np.float32
    q, k, v = _qkv(1, 1, 1, 16, 37, dim, dtype, seed=7)  # causal: the last query sees all 37
    qn, kn, vn = q[0, 0, 15].float().numpy(), k[0, 0].float().numpy(), v[0, 0].float().numpy()
    scale = f(0.125)

    def tree(lane):
        a = [lane[i] + lane[i + 8] for i in range(8)]
        b = [a[i] + a[i + 4] for i in range(4)]
        c = [b[i] + b[i + 2] for i in range(2)]
        return f(c[0] + c[1])

    scores = []
    for j in range(37):
        lane = [f(0.0)] * 16
        for x in range(dim):
            lane[x % 16] = f(lane[x % 16] + f(qn[x] * kn[j, x]))
        scores.append(f(tree(lane) * scale))
    m = max(scores)
    e = [_exp_cephes(f(s - m)) for s in scores]
    lanes = [f(0.0)] * 16
    for j, ej in enumerate(e):
        lanes[j % 16] = f(lanes[j % 16] + ej)
    total = tree(lanes)
    acc = np.zeros(dim, np.float32)
    for j, ej in enumerate(e):
        acc = (acc + ej * vn[j]).astype(np.float32)
    want = torch.from_numpy((acc / total).astype(np.float32)).to(dtype)
    head = (k[:, :, :10].contiguous(), v[:, :, :10].contiguous())
    for isa in range(native.attention_isa() + 1):
        alone = native.attention(q[:, :, 15:], k, v, None, 0.125, isa=isa)[0, 0, 0]
        both = native.attention(q, k, v, None, 0.125, isa=isa)[0, 15, 0]
        split = native.attention(q, k[:, :, 10:], v[:, :, 10:], None, 0.125, head=head,
                                 isa=isa)[0, 15, 0]
        assert torch.equal(alone, want) and torch.equal(both, want), isa
        assert torch.equal(split, want), isa
