"""The int4 layers' kernel (models/int4_matmul.c via models/native.py): the float definition's
sum, one set of bits per output whatever the batch, the threads, the tiling or the instruction
set, and `Int4Linear` on it where the CPU has AVX-512 BF16 or AVX2 with FMA and F16C."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvchat.models import native
from kvchat.models.quant import GROUP, Int4Linear, pack_int4_nibbles, quantize_int4

needs_library = pytest.mark.skipif(native.library() is None, reason=native.kernel_name())
needs_native = pytest.mark.skipif(not native.int4_native(), reason=native.int4_kernel_name())


def _weights(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, scales, zeros = quantize_int4(torch.randn(n, k, generator=gen))
    return q, pack_int4_nibbles(q), scales, zeros


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
    """pack_int4_nibbles' inverse, written from the layout's description in int4_matmul.c."""
    n = packed.shape[0]
    groups = k // GROUP
    q = torch.empty(n, k, dtype=torch.int64)
    p = packed.long()
    for g in range(groups):
        if g == groups - 1 and groups % 2:
            b = p[:, 16 * g : 16 * g + 16]
            q[:, 32 * g : 32 * g + 16], q[:, 32 * g + 16 : 32 * g + 32] = b & 15, b >> 4
        elif g % 2 == 0:
            b = p[:, 16 * g : 16 * g + 32]  # the pair's 32 bytes: columns 64p + i and + 32
            q[:, 32 * g : 32 * g + 32], q[:, 32 * g + 32 : 32 * g + 64] = b & 15, b >> 4
    return q


@pytest.mark.parametrize("k", [32, 64, 96, 576])
def test_the_nibbles_hold_each_column_where_the_layout_says(k):
    q, packed, _, _ = _weights(48, k)
    assert packed.shape == (48, k // 2) and packed.dtype == torch.uint8
    assert torch.equal(_unpack(packed, k), q.long())


@needs_library
@pytest.mark.parametrize("k", [32, 96, 128])
def test_every_path_computes_the_float_definition(k):
    q, packed, scales, zeros = _weights(64, k)
    x = _x(5, k)
    groups = k // GROUP
    w = (q.double().view(64, groups, GROUP) * scales.double()[..., None]
         + zeros.double()[..., None]).view(64, k)
    exact = x.double() @ w.t()
    for isa in range(native.int4_isa() + 1):
        out = native.int4_mm(x, packed, scales, zeros, isa=isa)
        assert out.dtype == torch.bfloat16 and out.shape == (5, 64)
        # one bfloat16 rounding of a float32 sum: within a few bfloat16 steps of the exact value
        assert torch.allclose(out.double(), exact, rtol=2**-7, atol=1e-3), isa


@needs_native
@pytest.mark.parametrize("k", [64, 96])
def test_a_row_gets_the_same_bits_alone_in_any_batch_under_any_threads_and_isa(k):
    # 4,200 rows of 96 columns cross the kernel's 192 KiB weight tiles
    n = 4200 if k == 96 else 80
    _, packed, scales, zeros = _weights(n, k)
    x = _x(11, k)
    alone = [native.int4_mm(x[i : i + 1], packed, scales, zeros, isa=0)[0] for i in range(11)]
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            for isa in range(native.int4_isa() + 1):
                for rows in (1, 2, 7, 8, 9, 11):
                    got = native.int4_mm(x[:rows], packed, scales, zeros, isa=isa)
                    for i in range(rows):
                        assert torch.equal(got[i], alone[i]), (n_threads, isa, rows, i)
    finally:
        torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("k", [32, 96, 576])
def test_tiny_and_odd_activations_give_every_path_the_same_bits(k):
    """Denormal and near-denormal inputs (their pair sums can be denormal: flushed), zeros of
    either sign, infinities, odd group counts: each path gives the portable definition's bits."""
    _, packed, scales, zeros = _weights(40, k, seed=5)
    x = _x(6, k, seed=6)
    x[0, :8] = torch.tensor([1e-39, -1e-39, 0.0, -0.0, 2**-120, -(2**-120) * 1.5, 3e-38, -2e-38])
    x[1] = x[1] * 2**-118  # every pair near the smallest normal: sums cancel into denormals
    x[2, 3] = float("inf")
    x[3, ::2] = -x[3, 1::2]  # exact cancellation in each pair
    portable = native.int4_mm(x, packed, scales, zeros, isa=0)
    for isa in range(1, native.int4_isa() + 1):
        got = native.int4_mm(x, packed, scales, zeros, isa=isa)
        assert torch.equal(got.view(torch.int16), portable.view(torch.int16)), isa
    # pairs that cancel into a denormal sum count as zero: with unit weights, unit scales and
    # zero zeros, such a row's outputs are exactly 0 on every path
    ones = pack_int4_nibbles(torch.ones(40, k, dtype=torch.uint8))
    unit, none = torch.ones(40, k // GROUP, dtype=torch.float16), torch.zeros_like(scales)
    a = 2.0**-120
    pairs = torch.tensor([a * (1 + 2**-7), -a] * (k // 2)).to(torch.bfloat16)[None]
    for isa in range(native.int4_isa() + 1):
        assert not native.int4_mm(pairs, ones, unit, none, isa=isa).any(), isa
    # rows without tiny values (no flush needed) give the same bits alone as beside them
    for row in (4, 5):
        alone = native.int4_mm(x[row : row + 1], packed, scales, zeros)
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
    want = native.int4_mm(x, pack_int4_nibbles(q), scales, zeros) + layer.bias
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


def test_an_x86_cpu_with_avx2_or_avx512_bf16_runs_the_native_kernel():
    """So that the tests above cannot skip where they should run: /proc/cpuinfo's flags decide."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags")
    if native._compiler() is None or native.library() is None:
        pytest.skip(native.kernel_name())
    bf16 = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"}.issubset(flags)
    avx2 = {"avx2", "fma", "f16c"}.issubset(flags)
    assert native.int4_isa() == (2 if bf16 else 1 if avx2 else 0), native.int4_kernel_name()
    assert native.int4_native() == (bf16 or avx2)


@needs_native
@pytest.mark.parametrize(("n", "k", "m"), [(64, 32, 1), (192, 576, 1), (960, 576, 7)])
def test_the_bound_matmul_gives_int4_mms_bits_and_checks_its_input(n, k, m):
    _, packed, scales, zeros = _weights(n, k)
    mm = native.int4_bound(packed, scales, zeros)
    x = _x(m, 2 * k)[:, ::2]  # not contiguous: copied first, as int4_mm does
    assert torch.equal(mm(x), native.int4_mm(x.contiguous(), packed, scales, zeros))
    with pytest.raises(ValueError, match="bfloat16"):
        mm(x.float())
    with pytest.raises(ValueError, match=f"\\(M, {k}\\)"):  # a narrower row is refused
        mm(_x(m, k - 16))
