"""quantize_int4 lays groups out as columns for speed; every value still takes the operations of
the plain per-group definition below, so the two agree bit for bit on weights on a full 4-bit
grid (Q4_1), on a partial one (Q4_K), off any grid (float weights, Q5_0 / Q6_K re-packed),
with constant groups, and mixed."""

from __future__ import annotations

import pytest
import torch

from kvchat.models.quant import _SNAP_TOLERANCE, _round_up, quantize_int4

_TINY = torch.finfo(torch.float32).tiny


def _on_grid(groups, lo, step):
    t = (groups - lo) / step.clamp_min(_TINY)
    return ((t - t.round()).abs() <= _SNAP_TOLERANCE).all(-1, keepdim=True)


def _reference(weight: torch.Tensor, group: int = 32):
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group, group)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    span = hi - lo
    step = span / 15
    found = _on_grid(groups, lo, step) | (span == 0)
    if not bool(found.all()):
        gaps = groups.sort(dim=-1).values.diff(dim=-1)
        smallest = torch.where(gaps > span * 1e-4, gaps, span).amin(-1, keepdim=True)
        levels = (span / smallest.clamp_min(_TINY)).round()
        candidate = span / levels.clamp(1, 15)
        fits = ~found & (levels <= 15) & _on_grid(groups, lo, candidate)
        step = torch.where(fits, candidate, step)
    scale = torch.where(span == 0, torch.zeros_like(step).half(), _round_up(step, torch.half))
    zero = lo.half()
    q = ((groups - zero.float()) / scale.float().clamp_min(_TINY)).round().clamp(0, 15)
    return q.to(torch.int32).reshape(n, k), scale[..., 0], zero[..., 0]


def _weights(kind: str) -> torch.Tensor:
    torch.manual_seed(3)
    n, k = 96, 128
    levels = torch.randint(0, 16, (n, k // 32, 32)).float()
    if kind == "full grid":
        levels[..., 0], levels[..., 1] = 0, 15
    scale = (torch.rand(n, k // 32, 1) * 0.01 + 1e-3).half().float()
    low = (torch.randn(n, k // 32, 1) * 0.01).half().float()
    on_grid = (levels * scale + low).reshape(n, k)
    if kind in ("full grid", "partial grid"):
        return on_grid
    if kind == "off grid":
        return torch.randn(n, k)
    if kind == "constant groups":
        w = torch.randn(n, k)
        w[:7] = 0.25
        w[10, :32] = -3.0
        return w
    on_grid[::3] = torch.randn(on_grid[::3].shape)
    return on_grid


@pytest.mark.parametrize("kind", ["full grid", "partial grid", "off grid", "constant groups",
                                  "mixed"])
def test_columns_layout_equals_the_per_group_definition(kind):
    weight = _weights(kind)
    q, scales, zeros = quantize_int4(weight)
    q_ref, scales_ref, zeros_ref = _reference(weight)
    assert q.shape == q_ref.shape and scales.shape == scales_ref.shape == zeros.shape
    assert torch.equal(q, q_ref) and torch.equal(scales, scales_ref)
    assert torch.equal(zeros, zeros_ref)


def test_a_grid_of_float16_steps_and_minimums_comes_back_exactly():
    # GGUF's Q4_1 stores each group's d and m as float16: the int4 layer holds those weights,
    # not a rounding of them (so int4 computes with the very weights of the float32 model)
    weight = _weights("full grid")
    q, scales, zeros = quantize_int4(weight)
    groups = q.float().view(96, 4, 32) * scales.float()[..., None] + zeros.float()[..., None]
    assert torch.equal(groups.view(96, 128), weight)
    # a grid whose groups need not reach level 0 (Q4_K) comes back to float16's precision
    weight = _weights("partial grid")
    q, scales, zeros = quantize_int4(weight)
    groups = q.float().view(96, 4, 32) * scales.float()[..., None] + zeros.float()[..., None]
    assert (groups.view(96, 128) - weight).abs().max() <= 2**-10 * weight.abs().max()
