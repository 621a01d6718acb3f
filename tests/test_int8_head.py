"""The output head's kernel (models/int8_head.c via models/native.py): the float definition's
sum, one set of bits per logit whatever the batch, the threads or the instruction set, and a
GGUF's Q8_0 head loaded as the file holds it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
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


@needs_kernel
def test_the_kernel_computes_the_float_definition():
    head = _head()
    x = _x(5)
    out = head(x)
    assert out.dtype == torch.float32 and out.shape == (5, 777)
    exact = x.double() @ head.dequantized().double().t()
    assert torch.allclose(out.double(), exact, rtol=1e-5, atol=1e-4)
    # and the torch path, for machines without a compiler, computes the same sum
    fallback = head_kernels._torch_mm(x.float(), head.qweight, head.scales, head.group)
    assert torch.allclose(fallback, out, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_row_gets_the_same_bits_alone_in_any_batch_under_any_threads_and_isa():
    head = _head()
    x = _x(9)
    alone = [head(x[i : i + 1])[0] for i in range(9)]
    best = native.library().kvchat_int8_head_isa()
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            for isa in range(best + 1):
                for rows in (1, 2, 3, 4, 5, 9):
                    got = head_kernels.int8_head_mm(x[:rows], head.qweight, head.scales, head.group,
                                              isa=isa)
                    for i in range(rows):
                        assert torch.equal(got[i], alone[i]), (n_threads, isa, rows, i)
    finally:
        torch.set_num_threads(threads)


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
