"""An output head kept as a GGUF's Q6_K blocks (models/block_head.c via block_head.py): its
integer definition (each activation block of 256 on a 16-bit grid of its own, exact integer
sums, one float chain per lane), one set of bits per logit whatever the batch, the threads or the
instruction set; the file's own numbers; and a tied model's embedding reading the same blocks,
held once, through a packed file and back."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import build_tiny_config, build_tiny_model, write_tiny_gguf
from head_sums import fma32, grid, tree16
from torch import nn

from kvchat.models import footprint, gguf_weights, head_kernels, native
from kvchat.models.block_head import BlockHeadLinear
from kvchat.models.loading import load_model
from kvchat.models.quant_embeddings import BlockEmbedding

Q6_K = gguf.GGMLQuantizationType.Q6_K
needs_kernel = pytest.mark.skipif(native.library() is None, reason=native.kernel_name())


def _blocks(n: int = 777, k: int = 512, seed: int = 3) -> np.ndarray:
    """Random Q6_K rows: any bytes, their float16 d small and finite (one row all zero scales)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    d = (rng.standard_normal((n, k // 256, 1)) * 0.001).astype(np.float16)
    raw[:, :, 208:] = d.view(np.uint8)
    raw[4, :, 192:208] = 0
    return raw.reshape(n, -1)


def _int8_groups(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The same weight as the int8 head's layout: q = the 6-bit value - 32, and per 16 columns
    the scale float32(d * sc), read from the bytes as llama.cpp's format documents them."""
    n = blocks.shape[0]
    b = blocks.reshape(-1, 210)
    ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
    scales = b[:, 192:208].view(np.int8).astype(np.float32) \
        * b[:, 208:].view(np.float16).astype(np.float32)
    q = np.empty((len(b), 2, 4, 32), np.int16)
    for r in range(4):
        low = (ql[:, :, 32 * (r % 2) : 32 * (r % 2) + 32] >> (4 * (r // 2))) & 15
        q[:, :, r] = (low | (((qh >> (2 * r)) & 3) << 4)).astype(np.int16) - 32
    return (torch.from_numpy(q.reshape(n, -1).astype(np.int8)),
            torch.from_numpy(scales.reshape(n, -1)))


def _head(blocks: np.ndarray) -> BlockHeadLinear:
    n, k = blocks.shape[0], blocks.shape[1] // 210 * 256
    return BlockHeadLinear(nn.Linear(k, n, bias=False, device="meta"),
                           torch.from_numpy(blocks.copy()))


def _x(m: int, k: int = 512, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_its_rows_are_the_files_numbers():
    blocks = _blocks()
    head = _head(blocks)
    assert head.whole()
    values = torch.from_numpy(gguf.dequantize(blocks, Q6_K).copy())
    assert torch.equal(head.dequantized(), values)
    q, scales = _int8_groups(blocks)
    assert torch.equal(head_kernels.int8_group_values(q, scales, 16), values)
    ids = torch.tensor([[3, 776], [4, 0]])
    assert torch.equal(head.rows(ids), values[ids])


def _definition(x: torch.Tensor, blocks: np.ndarray) -> torch.Tensor:
    """block_head.c's definition in torch: each activation block of 256 as integers on its
    power-of-two grid, exact integer sums per lane, the float32 chain over the blocks, the tree."""
    n, nb = blocks.shape[0], blocks.shape[1] // 210
    m = x.shape[0]
    q, _ = _int8_groups(blocks)
    raw = blocks.reshape(n, nb, 210)
    sc = torch.from_numpy(raw[:, :, 192:208].copy().view(np.int8).astype(np.int64))
    d = torch.from_numpy(raw[:, :, 208:210].copy().view(np.float16).astype(np.float32))[..., 0]
    w = q.long().view(n, nb, 16, 16) * sc[..., None]
    xi, unit = grid(x)
    xi = xi.view(m, nb, 256)
    lanes = torch.einsum("mbpls,nbpls->mnbl", xi.view(m, nb, 8, 16, 2),
                         w.view(n, nb, 8, 16, 2))  # exact: int64
    acc = torch.zeros(m, n, 16)
    for b in range(nb):
        scale = d[None, :, b] * unit[:, None, b]  # exact
        acc = fma32(lanes[:, :, b].float(), scale[..., None].expand(m, n, 16), acc)
    return tree16(acc)


@needs_kernel
def test_it_computes_its_integer_definition_in_any_batch_threads_or_isa():
    blocks = _blocks()
    head = _head(blocks)
    x = _x(11).float()  # float32: values off the grid too
    x[2, :256] *= 2.0 ** -12  # a block far below the others
    x[3, :256] = x[3, :256].clamp(-1.9, 1.9)
    x[3, 7] = 1.99999994  # the block's largest: rounds to 32768 on its grid, held at 32767
    assert torch.round(x[3, 7] * 2.0**14) == 32768 and x[3, :256].abs().max() == x[3, 7]
    x[4, 300:320] = 0.0
    x[5, :40] *= 1e-3  # small values in a block with large ones: rounded on its grid
    x[6, 0] = x[6, 1] = 3e-39  # denormals
    alone = [head(x[i : i + 1])[0] for i in range(11)]
    want = _definition(x, blocks)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            for isa in range(native.int4_isa() + 1):
                for rows in (1, 2, 3, 8, 9, 11):
                    got = head_kernels.q6k_head_mm(x[:rows], head.blocks, 512, isa=isa)
                    assert got.dtype == torch.float32 and torch.equal(got, want[:rows]), \
                        (n_threads, isa, rows)
                    for i in range(rows):
                        assert torch.equal(got[i], alone[i]), (n_threads, isa, rows, i)
    finally:
        torch.set_num_threads(threads)
    # within a grid unit per activation (half, but for the clamp) of the exact product, plus
    # float32's roundings
    values = head.dequantized().double()
    exact = x.double() @ values.t()
    e = (x.float().view(11, 2, 256).view(torch.int32) >> 23) & 0xFF
    unit = torch.pow(2.0, (e.amax(-1).clamp_min(15) - 141).double())
    units = unit.repeat_interleave(256, dim=1)
    bound = units @ values.abs().t() + 1e-5 * (x.double().abs() @ values.abs().t())
    assert ((head(x).double() - exact).abs() <= bound).all()
    assert not ((head(x).double() - exact).abs() <= bound / 50).all()  # the grid is felt


@needs_kernel
def test_a_block_holding_an_infinity_or_nan_gives_that_row_nan():
    blocks = _blocks(n=64, k=512)
    x = _x(3)
    x[1, 300] = torch.inf
    out = head_kernels.q6k_head_mm(x, torch.from_numpy(blocks.copy()), 512)
    assert out[1].isnan().all() and not out[0].isnan().any() and not out[2].isnan().any()
    assert torch.equal(out.nan_to_num(), _definition(x, blocks).nan_to_num())


def test_without_the_kernel_torch_computes_the_same_sum(monkeypatch):
    head = _head(_blocks(n=300, k=256))
    x = _x(3, k=256)
    exact = x.double() @ head.dequantized().double().t()
    monkeypatch.setattr(native, "library", lambda: None)
    monkeypatch.setattr(native, "gguf_blocks", lambda data, ggml_type: None)  # gguf-py's rows
    batch = head(x)
    assert torch.allclose(batch.double(), exact, rtol=1e-5, atol=1e-4)
    assert all(torch.equal(head(x[i : i + 1])[0], batch[i]) for i in range(3))
    # the int8 head's torch sum over the same weights, to the bit
    q, scales = _int8_groups(head.blocks.numpy())
    assert torch.equal(batch, head_kernels._torch_mm(x.float(), q, scales, 16))
    assert torch.equal(head_kernels.q6k_values(head.blocks), head.dequantized())


def test_other_heads_and_shapes_are_refused():
    head = nn.Linear(512, 40, bias=False)
    assert BlockHeadLinear.takes(head, int(Q6_K))
    assert not BlockHeadLinear.takes(head, int(gguf.GGMLQuantizationType.Q8_0))
    assert not BlockHeadLinear.takes(nn.Linear(512, 40), int(Q6_K))  # a bias
    assert not BlockHeadLinear.takes(nn.Linear(320, 40, bias=False), int(Q6_K))
    blocks = torch.from_numpy(_blocks(n=8, k=256).copy())
    with pytest.raises(ValueError, match="K=512"):
        head_kernels.q6k_head_mm(_x(1, k=512), blocks, 512)
    with pytest.raises(ValueError, match="no kernel"):
        head_kernels.q6k_head_mm(_x(1, k=200), blocks, 200)


def _tied_q6_k(tiny_tokenizer, tmp_path):
    config = build_tiny_config(tiny_tokenizer, hidden_size=256, intermediate_size=256,
                               num_hidden_layers=2, tie_word_embeddings=True)
    return write_tiny_gguf(build_tiny_model(config), tiny_tokenizer, tmp_path / "tied.gguf",
                           lambda name: "Q6_K" if name == "token_embd.weight" else "Q4_K")


@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_a_tied_q6_k_table_is_held_once_for_the_embedding_and_the_head(
        precision, tiny_tokenizer, tmp_path, monkeypatch):
    """The head keeps the file's blocks and the embedding reads its rows from them: one copy
    of the table, its rows the bfloat16 table's, its logits the file's numbers', the same
    again from the packed file a later load reads, and counted once by the estimate."""
    path = _tied_q6_k(tiny_tokenizer, tmp_path)
    first = load_model(str(path), dtype=precision)
    model = first.model
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(head, BlockHeadLinear) and isinstance(embed, BlockEmbedding) and embed.tied
    assert "model.embed_tokens.blocks" not in model.state_dict()
    table = [t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight"][0]
    values = torch.from_numpy(gguf.dequantize(table.data, Q6_K).copy())
    assert torch.equal(head.dequantized(), values)
    ids = torch.tensor([[5, 9, 2, 40, 7, 0]])
    assert torch.equal(embed.rows(ids), values[ids].to(torch.bfloat16))
    hidden = torch.randn(2, 256)
    if native.library() is not None:  # the kernel's definition over the file's blocks
        assert torch.equal(head(hidden), _definition(hidden, np.asarray(table.data)))
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    estimate = footprint._gguf_weights(path, precision, True).packed
    assert held - 256 <= estimate <= held, (estimate, held)  # less the rotary inv_freq
    assert footprint.gguf_head(path, tied=True).startswith("Q6_K")  # what `kvchat models` says
    assert footprint.gguf_head(path, tied=False).startswith("int8")  # it has no output.weight

    calls = []
    real = gguf_weights.load_gguf_weights
    monkeypatch.setattr(gguf_weights, "load_gguf_weights",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    second = load_model(str(path), dtype=precision)
    assert not calls  # read from the packed file the first load wrote
    head2, embed2 = second.model.get_output_embeddings(), second.model.get_input_embeddings()
    assert isinstance(head2, BlockHeadLinear) and isinstance(embed2, BlockEmbedding)
    assert embed2.tied and embed2._blocks() is head2.blocks
    assert torch.equal(head2.blocks, head.blocks)
    with torch.no_grad():
        assert torch.equal(second.model(ids).logits, first.model(ids).logits)


def test_on_a_gpu_the_head_and_its_tied_embedding_become_bfloat16_copies(
        tiny_tokenizer, tmp_path):
    """`place_on_gpu`'s step for them, on CPU: the embedding's table first (it reads the head's
    blocks, still on CPU), then the head's bfloat16 copy of its weight, its blocks let go."""
    from kvchat.models import gpu_weights

    loaded = load_model(str(_tied_q6_k(tiny_tokenizer, tmp_path)), dtype="int8")
    model = loaded.model
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    values = head.dequantized()
    ids = torch.arange(embed.num_embeddings)
    rows = embed.rows(ids)
    held = nn.Module()
    held.embed, held.head = embed, head
    gpu_weights.place_on_gpu(held, "cpu")
    assert torch.equal(embed.table, rows) and not embed.tied
    assert "blocks" not in dict(head.named_buffers())
    assert torch.equal(head.get_buffer("dense_weight"), values.to(torch.bfloat16))


def test_a_packed_file_whose_tied_embedding_lacks_its_head_is_packed_again(
        tiny_tokenizer, tmp_path, monkeypatch):
    """A file whose embedding entry says it reads the head's blocks, beside a head of another
    kind, is refused (PackedFileError), and the load packs afresh and replaces it."""
    from kvchat.models import packed_weights
    from kvchat.models.gguf import converted_dir_for
    from kvchat.models.loading import load_config, resolve_model
    from kvchat.models.quant import Int8HeadLinear, quantize_int8_groups

    path = _tied_q6_k(tiny_tokenizer, tmp_path)
    first = load_model(str(path), dtype="int4")
    model = first.model
    head = model.get_output_embeddings()
    q, scales = quantize_int8_groups(head.dequantized(), 32)
    model.lm_head = Int8HeadLinear.from_quantized(q, scales)  # the embedding still says tied
    config = load_config(resolve_model(str(path)))
    key = packed_weights.packed_key(path, "int4", "bfloat16", "LlamaForCausalLM",
                                    config.to_json_string())
    kept = packed_weights.packed_path(converted_dir_for(path), "int4", "bfloat16")
    packed_weights.save_packed(model, kept, key, first.facts.n_params)
    with pytest.raises(packed_weights.PackedFileError, match="head it lacks"):
        packed_weights.load_packed(kept, key, config, torch.bfloat16)
    calls = []
    real = gguf_weights.load_gguf_weights
    monkeypatch.setattr(gguf_weights, "load_gguf_weights",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    again = load_model(str(path), dtype="int4")
    assert calls == [1]  # packed afresh
    assert isinstance(again.model.get_output_embeddings(), BlockHeadLinear)
    load_model(str(path), dtype="int4")
    assert calls == [1]  # and that file read by the next load
