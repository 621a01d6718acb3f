"""Token embeddings read from packed weights instead of a bfloat16 table of their own: a tied
model's int8 head's rows (`TiedInt8Embedding`), or a GGUF's K-quant blocks (`BlockEmbedding`).
Both stand for a plain embedding or Gemma's scaled one, whose scale they apply as its forward
does, and give their rows in `out_dtype` (float32 under `kvchat.models.residual`).

`BlockEmbedding`: Llama 3.x and Qwen2.5 Q4_K_M files hold their (tied) token embedding as Q6_K:
0.82 bytes a value, where a bfloat16 table takes 2 (Llama 3.2 1B's 128,256 x 2,048: 205 MiB
against 501 MiB). It keeps the file's
bytes and de-quantizes only the rows a forward asks for (`native.gguf_blocks`, gguf-py's
numbers bit for bit, or gguf-py itself where the library is not built), rounded to the table's
dtype first: the very values a table de-quantized whole gave. A tied model whose head keeps
the same blocks (`block_head.BlockHeadLinear`) reads them from the head: one copy for both. On
a GPU it becomes that table (`to_table`), whose lookups need no CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from kvchat.models.block_head import BlockHeadLinear
    from kvchat.models.quant import Int8HeadLinear

_BF16 = torch.bfloat16
KINDS = (12, 14)  # GGMLQuantizationType Q4_K, Q6_K: the types gguf_blocks.c de-quantizes
_BLOCK_BYTES = {12: 144, 14: 210}  # per 256 values


def block_rows(blocks: torch.Tensor, ids: torch.Tensor, ggml_type: int, dim: int
               ) -> torch.Tensor:
    """The float32 values of rows `ids` (any shape) of `blocks` ((rows, bytes per row) uint8, a
    GGUF tensor's Q4_K or Q6_K rows): (*ids.shape, dim), gguf-py's numbers (`native.gguf_blocks`,
    or gguf-py itself where the library is not built)."""
    from kvchat.models.native import gguf_blocks

    picked = blocks.index_select(0, ids.reshape(-1).cpu()).numpy()
    values: Any = gguf_blocks(picked, ggml_type)
    if values is None:
        from gguf import GGMLQuantizationType, dequantize

        values = dequantize(picked, GGMLQuantizationType(ggml_type))
    return torch.from_numpy(values).reshape(*ids.shape, dim)


def block_table(blocks: torch.Tensor, ggml_type: int, dim: int, device: torch.device | None,
                dtype: torch.dtype) -> torch.Tensor:
    """Every row of `blocks` (`block_rows`' values) in `dtype` on `device`, de-quantized 8,192
    rows at a time on CPU: no float32 copy of the whole is held."""
    ids = torch.arange(blocks.shape[0])
    return torch.cat([block_rows(blocks, ids[i : i + 8192], ggml_type, dim)
                      .to(device=device, dtype=dtype) for i in range(0, len(ids), 8192)])


class _PackedEmbedding(nn.Module):
    """What both share: the embedding they stand for's padding index and scale, and the dtype
    their rows come out in."""

    def __init__(self, embed: nn.Module, dim: int) -> None:
        super().__init__()
        self.embedding_dim = dim
        self.padding_idx = getattr(embed, "padding_idx", None)
        scale = getattr(embed, "embed_scale", None)
        self.embed_scale: torch.Tensor | None
        if isinstance(scale, torch.Tensor):
            self.register_buffer("embed_scale", scale.detach().clone(), persistent=False)
        else:
            self.embed_scale = None
        self.out_dtype = _BF16  # float32 where the residual stream is (kvchat.models.residual)

    @staticmethod
    def plain(embed: nn.Module) -> bool:
        """A plain embedding, or one whose forward only multiplies by `embed_scale`."""
        return type(embed) is nn.Embedding or (
            type(embed).__name__.endswith("ScaledWordEmbedding")
            and isinstance(getattr(embed, "embed_scale", None), torch.Tensor))


class TiedInt8Embedding(_PackedEmbedding):
    """A tied model's token embedding read from its int8 head's rows: where those rows are
    exactly the file's numbers (a GGUF's Q8_0 table), the same values as a table of them,
    without holding one (Gemma 3 270M: 320 MiB)."""

    def __init__(self, embed: nn.Module, head: Int8HeadLinear) -> None:
        super().__init__(embed, head.in_features)
        self.num_embeddings = head.out_features
        self.__dict__["head"] = head  # not a submodule: the head owns the weights

    @property
    def device(self) -> torch.device:
        return self.__dict__["head"].get_buffer("qweight").device

    @staticmethod
    def takes(embed: nn.Module) -> bool:
        return _PackedEmbedding.plain(embed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.__dict__["head"].rows(ids).to(self.out_dtype)
        if self.embed_scale is not None:
            rows = rows * self.embed_scale.to(self.out_dtype)
        return rows


class BlockEmbedding(_PackedEmbedding):
    """`blocks`: (rows, bytes per row) uint8, the GGUF tensor's rows as the file holds them;
    or, given `head`, that head's own (a tied model's: not held twice)."""

    def __init__(self, embed: nn.Module, blocks: torch.Tensor | None, ggml_type: int, dim: int,
                 head: BlockHeadLinear | None = None) -> None:
        super().__init__(embed, dim)
        self.rows_wanted = getattr(embed, "num_embeddings", None)  # the table it stands for
        self.ggml_type = int(ggml_type)
        self.tied = head is not None
        if head is not None:
            self.__dict__["head"] = head  # not a submodule: the head owns the blocks
        else:
            self.register_buffer("blocks", blocks)
        self.table: torch.Tensor | None = None  # `to_table`'s

    @staticmethod
    def takes(embed: nn.Module, ggml_type: int) -> bool:
        """A plain or scaled embedding of a type this module de-quantizes."""
        return _PackedEmbedding.plain(embed) and int(ggml_type) in KINDS

    def _blocks(self) -> torch.Tensor:
        owner = self.__dict__["head"] if self.tied else self
        return owner.get_buffer("blocks")

    @property
    def num_embeddings(self) -> int:  # the rows held: a packed file's shell gets them later
        return int((self.table if self.table is not None else self._blocks()).shape[0])

    def whole(self) -> bool:
        """Whether its blocks are those of (rows, embedding_dim) values of its type."""
        blocks = self._blocks()
        rows = self.rows_wanted if isinstance(self.rows_wanted, int) else blocks.shape[0]
        return blocks.dim() == 2 and blocks.dtype == torch.uint8 and blocks.shape[0] > 0 \
            and blocks.shape[0] == rows \
            and self.embedding_dim % 256 == 0 \
            and blocks.shape[1] == self.embedding_dim // 256 * _BLOCK_BYTES[self.ggml_type]

    @property
    def device(self) -> torch.device:
        return (self.table if self.table is not None else self._blocks()).device

    @torch.compiler.disable  # numpy and C: outside a compiled graph, as the int4 kernel is
    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The table's rows `ids` (any shape): (*ids.shape, dim) bfloat16."""
        if self.table is not None:
            return nn.functional.embedding(ids, self.table)
        values = block_rows(self._blocks(), ids, self.ggml_type, self.embedding_dim)
        return values.to(_BF16).to(ids.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.rows(ids)  # scaled in bfloat16, as the table's own forward scales
        if self.embed_scale is not None:
            rows = rows * self.embed_scale.to(_BF16)
        return rows.to(self.out_dtype)

    def to_table(self, device: torch.device) -> None:
        """De-quantize every row once into a bfloat16 table on `device` (a GPU's lookups)."""
        table = block_table(self._blocks(), self.ggml_type, self.embedding_dim, device, _BF16)
        if self.tied:
            del self.__dict__["head"]  # the head makes its own copy on the device
            self.tied = False
        else:
            del self.blocks
        self.table = table

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, ggml_type={self.ggml_type}"
