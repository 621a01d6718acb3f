"""layer_ops.c: the rotary embedding is transformers' own arithmetic bit for bit; RMSNorm follows
its written definition, keeps each family's formula and dtypes once installed on a model's norm
modules, and is what both the model's forward and the fused decode forward run (whose logits
tests/test_fused_decode.py and test_fused_families.py hold bitwise to the model's own)."""

from __future__ import annotations

import copy
import io
import math
import struct

import pytest
import torch
from conftest import build_tiny_config, build_tiny_model
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from kvchat.engine.fused_decode import FusedDecoder, _rotate
from kvchat.engine.fused_norms import rms_norm as _fused_norm
from kvchat.engine.model_runner import ModelRunner
from kvchat.models import layer_ops, native
from kvchat.models.quant import quantize_model

needs_native = pytest.mark.skipif(native.library() is None, reason=native.kernel_name())


def _f32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def _definition(row: list[float], weight: list[float], eps: float, round_y: bool) -> list[float]:
    """layer_ops.c's RMSNorm of one row, op for op in Python (doubles; float32 where it rounds)."""
    lanes = [0.0] * 8
    for c, v in enumerate(row):
        lanes[c % 8] += v * v
    ss = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5])
                                                           + (lanes[6] + lanes[7]))
    r = _f32(1.0 / _f32(math.sqrt(_f32(_f32(ss / len(row)) + eps))))
    out = []
    for v, w in zip(row, weight, strict=True):
        y = _f32(v * r)
        if round_y:
            y = torch.tensor(y).bfloat16().item()
        out.append(_f32(w * y))
    return out


@needs_native
@pytest.mark.parametrize(("rows", "n", "x_dtype", "round_y"),
                         [(3, 64, torch.float32, False), (2, 72, torch.bfloat16, True),
                          (1, 8, torch.float32, True)])
def test_rms_norm_computes_its_definition(rows, n, x_dtype, round_y):
    g = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=g) * torch.logspace(-3, 3, n)).to(x_dtype)
    weight = torch.randn(n, generator=g)
    weight[0], weight[1] = -0.0, 0.0  # signed zeros kept: -0 * y is -0 for y > 0
    norm = layer_ops.NormWeight(weight, 1e-5, gemma=not round_y)  # Gemma's: times 1 + weight
    out = layer_ops.rms_norm(x, norm, torch.float32)
    multiplier = (weight if round_y else 1.0 + weight).tolist()
    for r in range(rows):
        expected = _definition(x[r].float().tolist(), multiplier, 1e-5,
                               round_y and x_dtype == torch.bfloat16)
        bits = torch.tensor(expected).view(torch.int32)
        assert out[r].view(torch.int32).tolist() == bits.tolist()
    assert torch.equal(layer_ops.rms_norm(x, norm, torch.bfloat16), out.bfloat16())
    assert torch.equal(layer_ops.rms_norm(x[1:], norm, torch.float32), out[1:])  # rows alone


def _awkward(rows: int, n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Values across float32's range, with zeros, denormals, infinities and NaNs among them."""
    x = torch.randn(rows, n, generator=g) * torch.exp2(torch.randint(-140, 120, (rows, n),
                                                                     generator=g).float())
    picks = torch.randint(0, 40, (rows, n), generator=g)
    x[picks == 0], x[picks == 1], x[picks == 2] = 0.0, float("inf"), float("nan")
    x[picks == 3] = 1e-40
    return x.to(dtype)


@needs_native
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
def test_every_instruction_sets_copy_gives_the_plain_c_bits(x_dtype, w_dtype, out_dtype, gemma):
    """The norm runs one copy per instruction set (plain C, AVX2, AVX-512: vectors of the
    definition's eight lanes): all give the same bits, on rows whose width is not a multiple of
    the vectors', per-head rows with two weights, and values at float32's edges (a NaN's payload
    aside: which of two NaN operands a product keeps is the compiler's choice)."""
    g = torch.Generator().manual_seed(int(gemma) + 2 * (x_dtype == torch.bfloat16))
    for n, rows, heads in ((1, 3, None), (13, 5, None), (72, 4, None), (1031, 3, None),
                           (64, 6, 4), (128, 2, 3)):
        width = n * (heads or 1)
        x = _awkward(rows, width, x_dtype, g)
        weight = _awkward(1, n, w_dtype, g)[0]
        other = torch.randn(n, generator=g).to(w_dtype) if heads else None
        norm = layer_ops.NormWeight(weight, 1e-6, gemma, other, split=1 if heads else 0)
        outs = [layer_ops.rms_norm(x, norm, out_dtype, heads=heads, isa=isa)
                for isa in (0, 1, -1)]
        nan = outs[0].isnan()
        bits = [o.masked_fill(nan, 0).view(torch.int32 if o.dtype == torch.float32
                                           else torch.int16) for o in outs]
        for other_out, other_bits in zip(outs[1:], bits[1:], strict=True):
            assert torch.equal(other_out.isnan(), nan), (n, heads)
            assert torch.equal(other_bits, bits[0]), (n, heads)


@needs_native
def test_per_head_norms_read_a_slice_of_wider_rows_in_place():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 6 * 16 + 40, generator=g).bfloat16()  # q | k heads, then v columns
    q_weight, k_weight = torch.randn(2, 16, generator=g).bfloat16()  # 4 q heads, then 2 k
    norm = layer_ops.NormWeight(q_weight, 1e-6, gemma=False, other=k_weight, split=4)
    out = layer_ops.rms_norm(wide[:, : 6 * 16], norm, torch.bfloat16, heads=6)
    assert out.shape == (5, 6, 16)
    for h in range(6):
        head = layer_ops.NormWeight(q_weight if h < 4 else k_weight, 1e-6, gemma=False)
        alone = layer_ops.rms_norm(wide[:, 16 * h : 16 * (h + 1)].contiguous(), head,
                                   torch.bfloat16)
        assert torch.equal(out[:, h], alone)
    torch_rows = norm.torch_weight(6)  # what the torch path multiplies by, row per head
    assert torch.equal(torch_rows, torch.stack([q_weight] * 4 + [k_weight] * 2))


@needs_native
@pytest.mark.parametrize(("shape", "dtype", "heads"),
                         [((3, 15), torch.bfloat16, None), ((3, 16), torch.float16, None),
                          ((3, 16 * 5), torch.float32, 6), ((3, 16 * 6), torch.float32, 6)])
def test_rms_norm_refuses_what_it_would_misread(shape, dtype, heads):
    norm = layer_ops.NormWeight(torch.ones(16), 1e-6, gemma=False)  # 6 heads: one weight for 1
    with pytest.raises(ValueError, match="rms_norm"):
        layer_ops.rms_norm(torch.ones(shape, dtype=dtype), norm, torch.float32, heads=heads)


@needs_native
@pytest.mark.parametrize(("x", "cos"), [((1, 2, 3, 8), (1, 3, 8)), ((1, 2, 3, 8), (2, 2, 8)),
                                        ((1, 2, 3, 8), (1, 2, 16)), ((1, 2, 3, 8), (1, 2, 6, 1)),
                                        ((2, 3, 8), (1, 2, 8))])
def test_rotary_refuses_what_it_would_misread(x, cos):
    with pytest.raises(ValueError, match="rotary"):
        layer_ops.rotary(torch.ones(x).bfloat16(), torch.ones(cos).bfloat16(),
                         torch.ones(cos).bfloat16())
    with pytest.raises(ValueError, match="rotary"):  # float16 for bfloat16
        layer_ops.rotary(torch.ones(1, 2, 3, 8).half(), torch.ones(1, 2, 8).bfloat16(),
                         torch.ones(1, 2, 8).bfloat16())


@needs_native
@pytest.mark.parametrize(("b", "q", "heads", "d", "r", "cos_rows"),
                         [(1, 1, 12, 64, 64, 1), (3, 5, 6, 32, 32, 3), (2, 4, 4, 96, 48, 1)])
def test_rotary_is_transformers_arithmetic_bit_for_bit(b, q, heads, d, r, cos_rows):
    g = torch.Generator().manual_seed(b * q * heads)
    wide = (torch.randn(b * q, heads * d + 24, generator=g) * 5).bfloat16()
    x = wide[:, : heads * d].view(b, q, heads, d)  # a strided slice, as the fused forward has
    cos = torch.randn(cos_rows, q, r, generator=g).bfloat16()
    sin = torch.randn(cos_rows, q, r, generator=g).bfloat16()
    out = layer_ops.rotary(x, cos, sin)
    if r == d:
        expected, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    else:  # partial rotary (Phi-3): the fused forward's own elementwise form
        expected = _rotate(x.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1))
    assert out.is_contiguous() and torch.equal(out, expected)


@needs_native
@pytest.mark.parametrize("module", [LlamaRMSNorm, Gemma3RMSNorm])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_an_installed_norm_keeps_its_formula_and_dtypes(module, x_dtype):
    norm = module(96, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    norm = norm.to(torch.bfloat16)
    x = (torch.randn(4, 3, 96) * 7).to(x_dtype)
    before = norm(x)
    assert layer_ops.native_norms(norm) == 1 and layer_ops.native_norms(norm) == 0
    after = norm(x)
    assert after.dtype == before.dtype and after.shape == before.shape
    assert torch.allclose(after.float(), before.float(), rtol=1e-2, atol=1e-5)
    copied = copy.deepcopy(norm)  # a copy runs on its own weight
    with torch.no_grad():
        copied.weight.mul_(2)  # and a changed weight is read again
    assert not torch.equal(copied(x), after) and torch.equal(norm(x), after)
    copied.weight.data.copy_(norm.weight.data)  # through `.data` too
    assert torch.equal(copied(x), after)
    saved = io.BytesIO()  # a model holding it still saves and loads whole
    torch.save(copied, saved)
    loaded = torch.load(io.BytesIO(saved.getvalue()), weights_only=False)
    assert layer_ops.is_native(loaded) and torch.equal(loaded(x), after)


@needs_native
def test_an_installed_norm_runs_on_a_weight_made_under_inference_mode():
    with torch.inference_mode():
        norm = LlamaRMSNorm(32, eps=1e-6)
        x = torch.randn(2, 32).bfloat16()
        before = norm(x)
        assert layer_ops.native_norms(norm) == 1
        after = norm(x)  # a weight with no version counter
        assert after.dtype == before.dtype and torch.allclose(after, before, rtol=1e-2)


@needs_native
@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_a_quantized_models_forward_and_the_fused_one_both_run_the_native_norm(
        tiny_tokenizer, precision):
    model = build_tiny_model(build_tiny_config(tiny_tokenizer))
    quantize_model(model, precision)
    decoder = model.get_decoder()
    assert layer_ops.is_native(decoder.norm) and layer_ops.is_native(
        decoder.layers[0].input_layernorm)
    fused = ModelRunner(model).fused
    assert isinstance(fused, FusedDecoder) and fused.norm.native
    assert all(layer.norm1.native for layer in fused.layers)


@needs_native
def test_the_fused_forward_follows_a_replaced_or_float16_norm_weight(tiny_tokenizer):
    model = build_tiny_model(build_tiny_config(tiny_tokenizer))
    quantize_model(model, "int4")
    fused = ModelRunner(model).fused
    norm = model.get_decoder().norm
    x = torch.randn(3, norm.weight.shape[0])
    before = _fused_norm(x, fused.norm)
    assert torch.equal(before, norm(x))
    norm.weight = torch.nn.Parameter(norm.weight.detach() * 2)  # another Parameter
    assert torch.equal(_fused_norm(x, fused.norm), norm(x))
    assert not torch.equal(_fused_norm(x, fused.norm), before)
    norm.half()  # a weight the native norm does not take: both forwards run torch's
    assert norm.weight.dtype == torch.float16
    assert torch.equal(_fused_norm(x, fused.norm), norm(x))

