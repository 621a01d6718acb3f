"""The int4 layers' kernel (models/int4_matmul.c via models/native.py): its tile layout, the
definition's bits on the portable path, one set of bits per output whatever the batch, the
threads or the instruction set, and `Int4Linear` on it where the CPU has AVX-512 VNNI or AVX2
with FMA and F16C."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvchat.models import native
from kvchat.models.quant import GROUP, Int4Linear, pack_int4, quantize_int4, unpack_int4

needs_library = pytest.mark.skipif(native.library() is None, reason=native.kernel_name())
needs_native = pytest.mark.skipif(not native.int4_native(), reason=native.int4_kernel_name())


def _weights(n: int, k: int, seed: int = 0):
    """(q, scales, zeros) by rows, and the same packed as the kernel reads them."""
    gen = torch.Generator().manual_seed(seed)
    q, scales, zeros = quantize_int4(torch.randn(n, k, generator=gen))
    return (q, scales, zeros), pack_int4(q, scales, zeros)


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The nibbles by rows, written from the layout's description in int4_matmul.c: group g of
    tile t at 256 (t * groups + g), byte 2 r + h of chunk s holding row r's column 2 s + h low
    and 16 + 2 s + h high."""
    n, groups = packed.shape[0], k // GROUP
    flat = packed.reshape(-1).long()
    q = torch.empty(n, k, dtype=torch.int64)
    for row in range(n):
        t, r = divmod(row, 16)
        for g in range(groups):
            for c in range(16):
                byte = flat[256 * (t * groups + g) + 32 * (c // 2) + 2 * r + c % 2]
                q[row, 32 * g + c], q[row, 32 * g + 16 + c] = byte & 15, byte >> 4
    return q


def _definition(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                ) -> torch.Tensor:
    """int4_matmul.c's definition, in torch: each activation group as integers on its power-of-
    two grid, exact integer sums, then the float32 chains over the groups in order."""
    m, k = x.shape
    n, groups = q.shape[0], k // GROUP
    bits = x.view(torch.int16).long() & 0xFFFF
    e, mant = (bits >> 7) & 0xFF, 128 | (bits & 0x7F)
    eg = e.view(m, groups, GROUP)
    top = eg.amax(-1).clamp_min(15)
    bad = (eg == 0xFF).any(-1)
    d = top[..., None] - eg
    sh = (d - 7).clamp(1, 8)
    down = mant.view(m, groups, GROUP) >> sh
    rem, half = mant.view(m, groups, GROUP) & ((1 << sh) - 1), 1 << (sh - 1)
    down = down + ((rem > half) | ((rem == half) & (down % 2 == 1))).long()
    val = torch.where(d <= 7, mant.view(m, groups, GROUP) << (7 - d).clamp_min(0), down)
    val = torch.where((d - 7 >= 9) | (eg == 0) | (eg == 0xFF), 0, val)
    val = torch.where((bits.view(m, groups, GROUP) & 0x8000) != 0, -val, val)
    unit = torch.pow(2.0, (top - 141).double())
    unit = torch.where(bad, float("nan"), unit)
    dot = torch.einsum("mgc,ngc->mng", val, q.long().view(n, groups, GROUP))  # exact
    xs = (val.sum(-1).double() * unit).float()  # S * u, exact
    a = torch.zeros(m, n, dtype=torch.float32)
    b = torch.zeros(m, n, dtype=torch.float32)
    for g in range(groups):  # fma in float32: the float64 sum is exact for these sizes
        t = (dot[..., g].double() * unit[:, g, None]).float().double()
        a = (t * scales[:, g].double() + a.double()).float()
        b = (xs[:, g, None].double() * zeros[:, g].double() + b.double()).float()
    return (a + b).to(torch.bfloat16)


@pytest.mark.parametrize("k", [32, 64, 96, 576])
def test_the_nibbles_hold_each_column_where_the_layout_says(k):
    (q, scales, zeros), (packed, s_tiles, z_tiles) = _weights(48, k)
    assert packed.shape == (48, k // 2) and packed.dtype == torch.uint8
    assert torch.equal(_unpack(packed, k), q.long())
    assert s_tiles.shape == scales.shape
    # tile t's group g: rows 16 t .. 16 t + 15's scales side by side
    assert torch.equal(s_tiles.reshape(3, k // GROUP, 16)[1, -1], scales[16:32, -1])
    back = unpack_int4(packed, s_tiles, z_tiles)
    assert torch.equal(back[0], q.to(torch.uint8)) and torch.equal(back[2], zeros)


@needs_library
@pytest.mark.parametrize("k", [32, 96, 128])
def test_every_path_computes_the_float_definition(k):
    (q, scales, zeros), packed = _weights(64, k)
    x = _x(5, k)
    x[1, :GROUP] *= torch.tensor([2.0**-12] * 16 + [1.0] * 16).to(torch.bfloat16)  # 12 binades
    groups = k // GROUP
    w = (q.double().view(64, groups, GROUP) * scales.double()[..., None]
         + zeros.double()[..., None]).view(64, k)
    exact = x.double() @ w.t()
    want = _definition(x, q, scales, zeros)
    for isa in range(native.int4_isa() + 1):
        out = native.int4_mm(x, *packed, isa=isa)
        assert out.dtype == torch.bfloat16 and out.shape == (5, 64)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), isa
        # one bfloat16 rounding of a float32 sum: within a few bfloat16 steps of the exact value
        assert torch.allclose(out.double(), exact, rtol=2**-7, atol=1e-3), isa


@needs_native
@pytest.mark.parametrize("k", [64, 96])
def test_a_row_gets_the_same_bits_alone_in_any_batch_under_any_threads_and_isa(k):
    # 263 tiles: split unevenly over 2 and 3 threads
    n = 4208 if k == 96 else 80
    _, packed = _weights(n, k)
    x = _x(70, k)  # past one cached chunk of 64 activation rows
    alone = [native.int4_mm(x[i : i + 1], *packed, isa=0)[0] for i in range(70)]
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            for isa in range(native.int4_isa() + 1):
                for rows in (1, 2, 7, 8, 9, 11, 70):
                    got = native.int4_mm(x[:rows], *packed, isa=isa)
                    for i in range(rows):
                        assert torch.equal(got[i], alone[i]), (n_threads, isa, rows, i)
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_every_bfloat16_pattern_is_written_on_its_groups_grid_alike_on_every_path():
    """Rows of random bit patterns (every exponent, ties in the rounding to the group's grid,
    NaNs and infinities among them) and rows of values within 24 binades: each path's bits are
    the definition's (a row holding a NaN or an infinity is all NaN on every path; where values
    near float32's largest overflow, a NaN's payload aside)."""
    k = 256
    (q, scales, zeros), packed = _weights(32, k, seed=9)
    g = torch.Generator().manual_seed(10)
    patterns = torch.randint(-(2**15), 2**15, (24, k), generator=g, dtype=torch.int32)
    near = torch.randint(0x3000, 0x3C00, (40, k), generator=g, dtype=torch.int32)  # 2^-31..2^-7
    near |= torch.randint(0, 2, near.shape, generator=g, dtype=torch.int32) << 15
    x = torch.cat([patterns, near]).to(torch.int16).view(torch.bfloat16)
    want = _definition(x, q, scales, zeros)
    nan = ~x.float().isfinite().all(1)
    assert nan.any() and (~nan).sum() >= 40
    for isa in range(native.int4_isa() + 1):
        got = native.int4_mm(x, *packed, isa=isa)
        assert got[nan].isnan().all(), isa
        assert torch.equal(got.isnan(), want.isnan()), isa
        assert torch.equal(got.nan_to_num(0.0, float("inf"), float("-inf")).view(torch.int16),
                           want.nan_to_num(0.0, float("inf"), float("-inf")).view(torch.int16)), isa


@needs_native
@pytest.mark.parametrize("k", [32, 96, 576])
def test_tiny_and_odd_activations_give_every_path_the_same_bits(k):
    """Denormal and tiny inputs, zeros of either sign, values 20 binades apart in one group,
    infinities, odd group counts: each path gives the portable definition's bits."""
    (q, scales, zeros), packed = _weights(48, k, seed=5)
    x = _x(6, k, seed=6)
    x[0, :8] = torch.tensor([1e-39, -1e-39, 0.0, -0.0, 2**-120, -(2**-120) * 1.5, 3e-38, -2e-38])
    x[1] = x[1] * 2**-118
    x[2, 3] = float("inf")
    x[3, 1] = x[3, 1] * 2**20
    portable = native.int4_mm(x, *packed, isa=0)
    finite = [0, 1, 3, 4, 5]  # row 2's NaNs: the same, whatever their payload
    assert torch.equal(portable[finite].view(torch.int16),
                       _definition(x, q, scales, zeros)[finite].view(torch.int16))
    for isa in range(1, native.int4_isa() + 1):
        got = native.int4_mm(x, *packed, isa=isa)
        assert torch.equal(got.view(torch.int16), portable.view(torch.int16)), isa
    assert portable[2].isnan().all() and not portable[[0, 1, 3, 4, 5]].isnan().any()
    # denormal activations count as zero: with unit weights and zero zeros, a row of them
    # gives exactly 0 on every path
    ones = pack_int4(torch.ones(48, k, dtype=torch.uint8), torch.ones(48, k // GROUP).half(),
                     torch.zeros(48, k // GROUP).half())
    tiny = torch.full((1, k), 1e-39).to(torch.bfloat16)
    for isa in range(native.int4_isa() + 1):
        assert not native.int4_mm(tiny, *ones, isa=isa).any(), isa
    # a row gives the same bits alone as beside the others
    for row in (3, 4, 5):
        alone = native.int4_mm(x[row : row + 1], *packed)
        assert torch.equal(alone[0].view(torch.int16), portable[row].view(torch.int16))


@needs_native
def test_int4_linear_runs_on_the_kernel_with_its_bias():
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(96, 48)
    linear.weight.data = torch.randn(48, 96, generator=gen)
    layer = Int4Linear(linear)
    assert layer.native and set(dict(layer.named_buffers())) == {"qweight", "scales", "zeros"}
    x = _x(4, 96)
    q, scales, zeros = quantize_int4(linear.weight)
    want = native.int4_mm(x, *pack_int4(q, scales, zeros)) + layer.bias
    assert torch.equal(layer(x), want)
    assert torch.equal(layer(x[None])[0], want)  # any leading shape
    # the same bytes as torch's layout: 4 bits a weight, a 16-bit scale and zero per group
    assert layer.weight_bytes() == 48 * 96 // 2 + 2 * 2 * 48 * 96 // GROUP + 2 * 48


def test_without_the_native_kernel_int4_keeps_torchs(monkeypatch):
    monkeypatch.setattr(native, "int4_native", lambda: False)
    layer = Int4Linear(nn.Linear(64, 32))
    assert not layer.native and "packed" in dict(layer.named_buffers())
    x = _x(3, 64)
    assert layer(x).shape == (3, 32)


def test_kvchat_models_names_the_int4_kernel(tiny_model_dir):
    from tests.test_cli import invoke, row

    result = invoke("models", "--model", str(tiny_model_dir), "--device", "cpu",
                    "--dtype", "int4")
    assert result.exit_code == 0, result.output
    assert row(result.output, "Int4 layers").endswith(native.int4_kernel_name())
    bf16 = invoke("models", "--model", str(tiny_model_dir), "--device", "cpu",
                  "--dtype", "bfloat16")
    assert "Int4 layers" not in bf16.output
    if native.attention_native():
        assert row(bf16.output, "Forward") == ("transformers' forward · kvchat's fixed-order "
                                               "attention · batch-invariant")
        forward = row(result.output, "Forward")
        assert forward.startswith("fused llama forward") and forward.endswith("batch-invariant")
    f16 = invoke("models", "--model", str(tiny_model_dir), "--device", "cpu",
                 "--dtype", "float16")
    assert "a batch can round a logit differently" in row(f16.output, "Forward")


def test_an_x86_cpu_with_avx2_or_avx512_vnni_runs_the_native_kernel():
    """So that the tests above cannot skip where they should run: /proc/cpuinfo's flags decide."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags")
    if native._compiler() is None or native.library() is None:
        pytest.skip(native.kernel_name())
    vnni = {"avx512f", "avx512bw", "avx512_vnni"}.issubset(flags)
    avx2 = {"avx2", "fma", "f16c"}.issubset(flags)
    assert native.int4_isa() == (2 if vnni else 1 if avx2 else 0), native.int4_kernel_name()
    assert native.int4_native() == (vnni or avx2)


@needs_native
@pytest.mark.parametrize(("n", "k", "m"), [(64, 32, 1), (192, 576, 1), (960, 576, 7)])
def test_the_bound_matmul_gives_int4_mms_bits_and_checks_its_input(n, k, m):
    _, packed = _weights(n, k)
    mm = native.int4_bound(*packed)
    x = _x(m, 2 * k)[:, ::2]  # not contiguous: copied first, as int4_mm does
    assert torch.equal(mm(x), native.int4_mm(x.contiguous(), *packed))
    with pytest.raises(ValueError, match="bfloat16"):
        mm(x.float())
    with pytest.raises(ValueError, match=f"\\(M, {k}\\)"):  # a narrower row is refused
        mm(_x(m, k - 16))


@needs_native
def test_a_weight_the_kernel_would_misread_is_refused_before_it_runs():
    """The kernel reads every byte by N and K: rows not in whole tiles of 16, scales of another
    shape, a transposed view or a narrower input are refused with what was expected."""
    _, (q, scales, zeros) = _weights(64, 64)
    x = _x(3, 64)
    with pytest.raises(ValueError, match="N % 16 == 0"):
        native.int4_mm(x, q[:24], scales[:24], zeros[:24])
    with pytest.raises(ValueError, match="N % 16 == 0"):
        native.int4_bound(q[:40], scales[:40], zeros[:40])
    with pytest.raises(ValueError, match=r"\(N, K / 32\) float16 scales"):
        native.int4_mm(x, q, scales[:, :1].contiguous(), zeros)
    with pytest.raises(ValueError, match="contiguous"):
        native.int4_bound(q, scales.t().contiguous().t(), zeros)
    with pytest.raises(ValueError, match=r"\(M, 64\)"):
        native.int4_mm(_x(3, 32), q, scales, zeros)
    assert torch.equal(native.int4_mm(x, q, scales, zeros), native.int4_bound(q, scales, zeros)(x))
