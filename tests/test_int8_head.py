"""The output head's kernel (models/int8_head.c via head_kernels.py): its integer definition
(each activation block of 256 on a 16-bit grid of its own, exact integer sums of four columns a
lane, float32 chains per block and over them), one set of bits per logit whatever the batch, the
threads or the instruction set, and a GGUF's Q8_0 head loaded as the file holds it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from head_sums import fma32, grid, tree16
from torch import nn

from kvchat.models import head_kernels, native
from kvchat.models.quant import Int8HeadLinear, quantize_int8_groups

needs_kernel = pytest.mark.skipif(native.library() is None, reason=native.kernel_name())


def _head(n: int = 777, k: int = 96, seed: int = 0) -> Int8HeadLinear:
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(k, n, bias=False)
    layer.weight.data = torch.randn(n, k, generator=gen)
    return Int8HeadLinear(layer)


def _x(m: int, k: int = 96, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _definition(x: torch.Tensor, head: Int8HeadLinear) -> torch.Tensor:
    """int8_head.c's definition in torch: the activation grid, exact integer sums of four
    columns a lane over spans of 64, a float32 chain per block of 256 with the lanes' scales,
    then one over the blocks with their units, the tree."""
    q, scales, group = head.qweight, head.scales, head.group
    (m, k), n = x.shape, q.shape[0]
    spans, blocks = -(-k // 64), -(-k // 256)
    xi, unit = grid(x)
    lanes = torch.einsum("mplc,nplc->mnpl",
                         nn.functional.pad(xi, (0, spans * 64 - k)).view(m, spans, 16, 4),
                         nn.functional.pad(q.long(), (0, spans * 64 - k)).view(n, spans, 16, 4))
    first = torch.arange(0, spans * 64, 4).view(spans, 16)  # each lane's first column
    scale = torch.where(first < k, scales[:, (first // group).clamp_max(k // group - 1)], 0.0)
    acc = torch.zeros(m, n, 16)
    for b in range(blocks):
        a = torch.zeros(m, n, 16)
        for p in range(4 * b, min(4 * b + 4, spans)):
            a = fma32(lanes[:, :, p].float(), scale[None, :, p].expand(m, n, 16), a)
        acc = fma32(a, unit[:, None, b, None].expand(m, n, 16), acc)
    return tree16(acc)


@needs_kernel
@pytest.mark.parametrize("k", [96, 48, 576, 640])
def test_it_computes_its_integer_definition_in_any_batch_threads_or_isa(k):
    """K = 96: a last span of 32 columns; 48: one scale a row, a span of 48; 576 and 640: the
    widths of SmolLM2's and Gemma 3's heads, a last block of 64 and of 128 columns."""
    head = _head(n=203, k=k)
    x = _x(11, k=k).float()  # float32: values off the grid too
    x[2, : min(k, 256)] *= 2.0**-12  # a block far below the others
    x[3, : min(k, 256)] = x[3, : min(k, 256)].clamp(-1.9, 1.9)
    x[3, 7] = 1.99999994  # the block's largest: rounds to 32768 on its grid, held at 32767
    assert torch.round(x[3, 7] * 2.0**14) == 32768
    x[4, 20:40] = 0.0
    x[5, :40] *= 1e-3  # small values in a block with large ones: rounded on its grid
    x[6, 0] = x[6, 1] = 3e-39  # denormals
    head.qweight[7, :32] = -128  # the int8 range's end, which a file may hold
    head.qweight[8] = 127
    head.scales[9, -1] = torch.inf  # a lane without columns would make it nan
    want = _definition(x, head)
    alone = [head(x[i : i + 1])[0] for i in range(11)]
    best = native.library().kvchat_int8_head_isa()
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            for isa in range(best + 1):
                for rows in (1, 2, 3, 8, 9, 11):
                    got = head_kernels.int8_head_mm(x[:rows], head.qweight, head.scales,
                                                    head.group, isa=isa)
                    assert got.dtype == torch.float32 and torch.equal(
                        got.nan_to_num(), want[:rows].nan_to_num()), (n_threads, isa, rows)
                    for i in range(rows):
                        assert torch.equal(got[i].nan_to_num(), alone[i].nan_to_num())
    finally:
        torch.set_num_threads(threads)
    # within a grid unit per activation (half, but for the clamp) of the exact product, plus
    # float32's roundings
    values = head.dequantized().double()
    ok = values.isfinite().all(1)
    exact = x.double() @ values[ok].t()
    e = (nn.functional.pad(x, (0, -k % 256)).view(11, -1, 256).view(torch.int32) >> 23) & 0xFF
    unit = torch.pow(2.0, (e.amax(-1).clamp_min(15) - 141).double())
    units = unit.repeat_interleave(256, dim=1)[:, :k]
    bound = units @ values[ok].abs().t() + 1e-5 * (x.double().abs() @ values[ok].abs().t())
    assert ((head(x)[:, ok].double() - exact).abs() <= bound).all()
    assert ((head(x)[:, ok].double() - exact).abs() > bound / 200).any()  # the grid is felt


@needs_kernel
def test_a_block_holding_an_infinity_or_nan_gives_that_row_nan():
    head = _head(n=64, k=576)
    x = _x(3, k=576).float()
    x[1, 300] = torch.nan
    out = head_kernels.int8_head_mm(x, head.qweight, head.scales, head.group)
    assert out[1].isnan().all() and not out[0].isnan().any() and not out[2].isnan().any()


def test_without_the_kernel_torch_computes_the_same_sum(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    head = _head()
    x = _x(5)
    exact = x.double() @ head.dequantized().double().t()
    assert torch.allclose(head(x).double(), exact, rtol=1e-5, atol=1e-4)


def test_a_row_gets_the_same_bits_in_any_batch_without_the_kernel(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    head = _head()
    x = _x(6)
    batch = head(x)
    assert all(torch.equal(head(x[i : i + 1])[0], batch[i]) for i in range(6))
    assert "torch" in native.kernel_name()


def test_a_head_whose_width_is_not_whole_groups_takes_one_scale_per_row():
    head = _head(n=40, k=48)
    assert head.group == 48 and head.scales.shape == (40, 1)
    x = _x(2, k=48)
    exact = x.double() @ head.dequantized().double().t()
    assert torch.allclose(head(x).double(), exact, rtol=1e-5, atol=1e-4)


def test_q8_0_numbers_come_back_exactly():
    """A GGUF's Q8_0 head, de-quantized and grouped again, is the file's own int8 and scales:
    each group's largest value is 127 of its steps, and scale * 127 / 127 is exact in float32
    for a float16 scale."""
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((64, 128)).astype(np.float32) * 0.05
    weight[5, :32] = 0.0  # a group of zeros
    blocks = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    values = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0))
    q, scales = quantize_int8_groups(values, 32)
    raw = blocks.reshape(64, 4, 34)
    assert torch.equal(scales, torch.from_numpy(
        raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)))
    assert torch.equal(q, torch.from_numpy(raw[..., 2:].copy().view(np.int8).reshape(64, 128)))
    head = Int8HeadLinear.from_quantized(q, scales)
    assert torch.equal(head.dequantized(), values.float())


def test_q8_0_rows_are_read_as_the_files_q_and_d_without_de_quantizing():
    """The loader reads a Q8_0 head's blocks straight into q and scales: the file's own, also in
    a block whose steps stop short of 127 (where grouping again would pick another scale), and
    the same as de-quantizing and grouping again everywhere else."""
    from kvchat.models.gguf_weights import _q8_0_rows
    from kvchat.models.head_kernels import int8_group_values

    rng = np.random.default_rng(4)
    weight = rng.standard_normal((64, 128)).astype(np.float32) * 0.05
    blocks = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    raw = blocks.reshape(64, 4, 34)
    raw[3, 1, 2:] = (raw[3, 1, 2:].view(np.int8) // 2).view(np.uint8)  # at most 64 steps
    q, scales = _q8_0_rows(blocks, 128)
    assert torch.equal(q, torch.from_numpy(raw[..., 2:].copy().view(np.int8).reshape(64, 128)))
    assert torch.equal(scales, torch.from_numpy(
        raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)))
    values = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0))
    assert torch.equal(int8_group_values(q, scales, 32), values)
    again_q, again_scales = quantize_int8_groups(values, 32)
    differs = (again_scales != scales).nonzero().tolist()
    assert differs == [[3, 1]]
    assert torch.equal(again_q.view(64, 4, 32)[:, 0], q.view(64, 4, 32)[:, 0])


def test_the_library_is_built_once_and_privately(tmp_path, monkeypatch):
    if native._compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path))
    native.library.cache_clear()
    try:
        assert native.library() is not None
        built = list((tmp_path / "native").iterdir())
        assert len(built) == 1 and built[0].suffix == ".so"
        assert (tmp_path / "native").stat().st_mode & 0o077 == 0
        monkeypatch.setenv("KVCHAT_NATIVE", "0")
        native.library.cache_clear()
        assert native.library() is None and "KVCHAT_NATIVE=0" in native.kernel_name()
    finally:
        native.library.cache_clear()


def test_gemmas_scaled_embedding_read_from_the_head_gives_its_own_numbers():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from kvchat.models.quant_embeddings import TiedInt8Embedding

    head = _head(n=300, k=64)
    own = Gemma3TextScaledWordEmbedding(300, 64, padding_idx=0, embed_scale=64**0.5)
    own.weight.data = head.dequantized().to(torch.bfloat16)
    own.embed_scale.fill_(64**0.5)
    assert TiedInt8Embedding.takes(own)
    ours = TiedInt8Embedding(own, head)
    ids = torch.tensor([[0, 5, 299, 17], [3, 3, 2, 1]])
    assert torch.equal(ours(ids), own(ids))
    assert not list(ours.parameters())  # the head holds the numbers
