"""A K-quant token embedding kept as the file's blocks gives, row for row, the bfloat16 table
de-quantized whole, scaled (Gemma) or not, in the residual's dtype, from kvchat's C or from
gguf-py, and as a table on a device; at a fraction of the table's bytes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from kvchat.models import native
from kvchat.models.quant_embeddings import BlockEmbedding


class FakeScaledWordEmbedding(nn.Embedding):
    """What Gemma's scaled embedding is to `BlockEmbedding.takes`: an embedding times a scale."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__(rows, dim)
        self.register_buffer("embed_scale", torch.tensor(dim**0.5), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


def _file_table(qtype: str, rows: int = 300, dim: int = 512):
    """Random blocks of `qtype` (their float16 fields small and finite) and gguf-py's table."""
    kind = gguf.GGMLQuantizationType[qtype]
    values, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (rows, dim // values, size), dtype=np.uint8)
    halves = (rng.standard_normal((rows, dim // values, 2)) * 0.01).astype(np.float16)
    fields = [0, 2] if qtype == "Q4_K" else [size - 2]  # d, dmin / d
    for i, offset in enumerate(fields):
        raw[:, :, offset : offset + 2] = halves[:, :, i : i + 1].view(np.uint8)
    blocks = raw.reshape(rows, -1)
    return kind, blocks, torch.from_numpy(gguf.dequantize(blocks, kind).copy())


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("built", [True, False])
def test_rows_are_the_tables_rows(qtype, scaled, built, monkeypatch):
    kind, blocks, table = _file_table(qtype)
    if not built:  # no native library: gguf-py de-quantizes the rows
        monkeypatch.setattr(native, "gguf_blocks", lambda data, ggml_type: None)
    plain = FakeScaledWordEmbedding(*table.shape) if scaled else nn.Embedding(*table.shape)
    plain.weight = nn.Parameter(table.to(torch.bfloat16), requires_grad=False)
    assert BlockEmbedding.takes(plain, int(kind))
    assert not BlockEmbedding.takes(plain, int(gguf.GGMLQuantizationType.Q8_0))
    embed = BlockEmbedding(plain, torch.from_numpy(blocks.copy()), int(kind), table.shape[1])
    ids = torch.tensor([[0, 299, 5, 5], [17, 3, 250, 1]])
    with torch.no_grad():
        want = plain(ids)
        assert torch.equal(embed(ids), want)
        embed.out_dtype = torch.float32  # the float32 residual: the same values, widened
        assert torch.equal(embed(ids), want.float())
        embed.to_table(torch.device("cpu"))
        assert torch.equal(embed(ids), want.float())
    assert blocks.nbytes < 0.5 * table.numel() * 2  # against the bfloat16 table's bytes


def test_other_embeddings_are_not_taken():
    class Positional(nn.Embedding):
        pass

    assert not BlockEmbedding.takes(Positional(4, 8), int(gguf.GGMLQuantizationType.Q6_K))
