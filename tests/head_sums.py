"""The head kernels' shared definitions in torch, for their tests (test_block_head.py,
test_int8_head.py): the activation grid (native_sums.h's grid_row), a float32 fma with one
rounding, and the fixed tree over 16 lanes."""

from __future__ import annotations

import torch


def grid(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_int (M, K) int64, units (M, blocks) float32): each block of 256 columns (the last may
    be shorter) on the power-of-two grid of its largest exponent, 15 bits against it, clamped
    to +-32767; a block holding an infinity or NaN is 0 with a NaN unit."""
    m, k = x.shape
    nb = -(-k // 256)
    xf = torch.nn.functional.pad(x.float(), (0, nb * 256 - k)).view(m, nb, 256)
    e = (xf.view(torch.int32) >> 23) & 0xFF
    top = e.amax(-1).clamp_min(15)
    bad = (e == 0xFF).any(-1)
    inv = torch.pow(2.0, (141 - top).float())
    xi = torch.round(xf * inv[..., None]).clamp(-32767, 32767).long()
    xi = torch.where(bad[..., None], 0, xi)
    unit = torch.where(bad, torch.nan, torch.pow(2.0, (top - 141).float()))
    return xi.view(m, -1)[:, :k], unit


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 fma, one rounding, where a * b is exact in float64 (at most 53 bits between
    them): the sum's float64 error (TwoSum) settles a float32 tie that float64's rounding
    made."""
    p, cd = a.double() * b.double(), c.double()
    s = p + cd
    back = s - p
    err = (p - (s - back)) + (cd - back)
    r = s.float()
    rd = r.double()
    other = torch.nextafter(r, torch.where(rd > s, -torch.inf, torch.inf).float())
    tie = ((rd - s).abs() == (other.double() - s).abs()) & (err != 0)
    above, below = torch.where(rd > s, r, other), torch.where(rd > s, other, r)
    return torch.where(tie, torch.where(err > 0, above, below), r)


def tree16(lanes: torch.Tensor) -> torch.Tensor:
    """The kernels' sum of the last dimension's 16 lanes: l + l+8, then + l+4, + l+2, + l+1."""
    a = lanes[..., :8] + lanes[..., 8:]
    a = a[..., :4] + a[..., 4:]
    a = a[..., :2] + a[..., 2:]
    return a[..., 0] + a[..., 1]
