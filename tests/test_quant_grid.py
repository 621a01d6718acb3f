"""quantize_int4 lays groups out as columns for speed (torch), or finds each group's grid in C
(int4_grid.c, where the native library is built); every value still takes the operations of the
plain per-group definition below, so all three agree bit for bit on weights on a full 4-bit
grid (Q4_1), on a partial one (Q4_K), off any grid (float weights, Q5_0 / Q6_K re-packed),
with constant groups, and mixed."""

from __future__ import annotations

import pytest
import torch

from kvchat.models import native
from kvchat.models.quant import (
    _SNAP_TOLERANCE,
    _quantize_int4_torch,
    _round_up,
    quantize_int4,
)

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


KINDS = ["full grid", "partial grid", "off grid", "constant groups", "mixed"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("grid", [quantize_int4, _quantize_int4_torch], ids=["default", "torch"])
def test_columns_layout_equals_the_per_group_definition(kind, grid):
    weight = _weights(kind)
    q, scales, zeros = grid(weight, 32)
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


def _hard_weights() -> dict[str, torch.Tensor]:
    """Weights where rounding could go either way: a Q4_K-like grid whose step and minimum are
    float32 products (not float16), levels 0, 2, 4... only (a coarser grid fits), values past
    float16's range, steps in float16's subnormals, and every group of a real K-quant file's
    tensors as gguf-py decodes them."""
    import gguf
    import numpy as np
    from conftest import gguf_tensor

    torch.manual_seed(5)
    n, k = 64, 256
    levels = torch.randint(0, 16, (n, k // 32, 32)).float()
    step = torch.rand(n, k // 32, 1) * 0.013 + 1e-4
    low = torch.randn(n, k // 32, 1) * 0.02
    out = {
        "float32 grid": (levels * step - low).reshape(n, k),
        "even levels": ((levels // 2 * 2) * step + low).reshape(n, k),
        "beyond float16": torch.randn(n, k) * 4e4,
        "subnormal steps": (levels * 3e-7 + torch.randn(n, k // 32, 1) * 1e-6).reshape(n, k),
    }
    for qtype in ("Q4_K", "Q6_K", "Q5_0", "Q8_0"):
        raw, kind = gguf_tensor(np.random.default_rng(1).standard_normal((n, k)).astype(
            np.float32) * 0.02, qtype)
        out[qtype] = torch.from_numpy(gguf.dequantize(raw, kind).copy()).float()
    return out


@pytest.mark.skipif(native.library() is None, reason="no native library (no C compiler)")
@pytest.mark.parametrize("kind", [*KINDS, "float32 grid", "even levels", "beyond float16",
                                  "subnormal steps", "Q4_K", "Q6_K", "Q5_0", "Q8_0"])
def test_native_grid_is_the_torch_grid_bit_for_bit(kind):
    weight = _weights(kind) if kind in KINDS else _hard_weights()[kind]
    found = native.int4_grid(weight)
    assert found is not None
    q, scales, zeros = found
    want = _quantize_int4_torch(weight, 32)
    assert torch.equal(q.to(torch.int32), want.q)
    assert torch.equal(scales.view(torch.int16), want.scales.view(torch.int16))
    assert torch.equal(zeros.view(torch.int16), want.zeros.view(torch.int16))


def test_a_nan_falls_back_to_torch():
    weight = _weights("off grid")
    weight[3, 40] = float("nan")
    assert native.int4_grid(weight) is None
    assert quantize_int4(weight).q.shape == weight.shape


@pytest.mark.skipif(native.library() is None, reason="no native library (no C compiler)")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_native_k_quant_blocks_are_gguf_pys_numbers(qtype):
    """Random blocks, their float16 scales random finite values of either sign (normal and
    subnormal): gguf_blocks.c gives gguf-py's float32 numbers bit for bit, and another type is
    left to gguf-py."""
    import gguf
    import numpy as np

    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, (24, 5, size), dtype=np.uint8)
    halves = rng.standard_normal((24, 5, 2)).astype(np.float16)
    halves[0, 0] = np.float16(3e-6)  # subnormal float16
    fields = [0, 2] if qtype == "Q4_K" else [size - 2]  # d, dmin / d: where gguf-py reads them
    for i, offset in enumerate(fields):
        raw[:, :, offset : offset + 2] = halves[:, :, i : i + 1].view(np.uint8)
    data = raw.reshape(24, 5 * size)
    got = native.gguf_blocks(data, int(kind))
    want = gguf.dequantize(data, kind)
    assert got is not None and got.shape == want.shape == (24, 5 * block)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert native.gguf_blocks(data, int(gguf.GGMLQuantizationType.Q8_0)) is None


@pytest.mark.skipif(not native.int4_native(), reason="the int4 layers run on torch's kernel here")
@pytest.mark.parametrize(("qtype", "groups"), [("Q4_K", 16), ("Q4_1", 8), ("Q4_1", 7)])
def test_q4_rows_read_as_they_are_hold_the_files_grid(qtype, groups):
    """Random Q4_K / Q4_1 rows (float16 fields of either sign, one subnormal) read straight
    into the int4 layout: the nibbles are the file's, each group's scale and zero the file's
    float16 d and m (Q4_1) or float16(d * sc) and float16(-(dmin * m)) (Q4_K, from gguf-py's
    own unpacking of the 6-bit fields), and q * scale + zero is gguf-py's value to float16's
    rounding of those two."""
    import gguf
    import numpy as np

    from kvchat.models.quant import unpack_int4

    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    n, k = 32, groups * 32  # two tiles of 16 rows
    rng = np.random.default_rng(11)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    halves = (rng.standard_normal((n, k // block, 2)) * 0.01).astype(np.float16)
    halves[0, 0] = np.float16(3e-6)
    raw[:, :, 0:4] = halves.view(np.uint8)
    data = raw.reshape(n, k // block * size)
    found = native.int4_from_blocks(data, int(kind))
    assert found is not None
    assert found[0].shape == (n, k // 2) and found[1].shape == found[2].shape == (n, groups)
    q_rows, scales, zeros = unpack_int4(*found)
    q = q_rows.numpy()
    d = halves[..., 0].astype(np.float32)
    m = halves[..., 1].astype(np.float32)
    if qtype == "Q4_1":
        want_scales, want_zeros = halves[..., 0], halves[..., 1]
        qs = raw[:, :, 4:]
        want_q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k)
    else:
        sc, mins = gguf.quants.Q4_K.get_scale_min(raw[:, :, 4:16].reshape(-1, 12))
        sc, mins = sc.reshape(n, -1, 8), mins.reshape(n, -1, 8)
        want_scales = (d[..., None] * sc.astype(np.float32)).astype(np.float16).reshape(n, -1)
        want_zeros = (-(m[..., None] * mins.astype(np.float32))).astype(np.float16).reshape(n, -1)
        qs = raw[:, :, 16:].reshape(n, k // block, 4, 1, 32)
        want_q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, k)
    assert np.array_equal(scales.numpy().view(np.uint16), want_scales.view(np.uint16))
    assert np.array_equal(zeros.numpy().view(np.uint16), want_zeros.view(np.uint16))
    assert np.array_equal(q, want_q)
    values = q.reshape(n, groups, 32) * scales.float().numpy()[..., None] \
        + zeros.float().numpy()[..., None]
    file_values = gguf.dequantize(data, kind).reshape(n, groups, 32)
    slack = 16 * 2.0**-11 * (np.abs(scales.float().numpy()) + np.abs(zeros.float().numpy()))
    assert (np.abs(values - file_values) <= slack[..., None] + 2.0**-24).all()
    if qtype == "Q4_1":  # its grid is the file's, exactly
        assert np.array_equal(values.astype(np.float32), file_values)
    assert native.int4_from_blocks(data, int(gguf.GGMLQuantizationType.Q6_K)) is None
    assert native.int4_from_blocks(data[:24], int(kind)) is None  # rows not in whole tiles
