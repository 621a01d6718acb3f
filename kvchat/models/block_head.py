"""The output head kept as a GGUF's Q6_K blocks, the type llama.cpp's Q4_K_M and Q5_K_M files
give their head (or the token embedding a tied head reads): 0.82 bytes a weight where the int8
head packed from the same numbers takes 1.125, and exactly the file's numbers where that head
re-rounds them to its own grid.

A Q6_K weight is d * sc * (q - 32), d a float16 per 256 columns and sc an int8 per 16. The
kernel (block_head.c says how) multiplies integers: each activation block of 256 on a 16-bit
grid of its own (15 bits against its largest value), the products with q * sc summed exactly,
one float32 fma per lane and block; a row's logits are bitwise the same alone, in a batch,
under any number of threads and on AVX-512 VNNI, AVX2 or plain C; each thread reads its rows
in the file's order, which kept the head near the memory's speed where four rows read side by
side did not. A tied model's embedding reads its rows from these blocks (`BlockEmbedding`
with `head`): one copy of the table instead of two.
"""

from __future__ import annotations

import torch
from torch import nn

from kvchat.models.quant import QuantLinear
from kvchat.models.quant_embeddings import block_rows, block_table

Q6_K = 14  # GGMLQuantizationType
BLOCK_BYTES = 210  # per 256 values
GROUP = 16  # columns per scale
_BF16 = torch.bfloat16


class BlockHeadLinear(QuantLinear):
    """`blocks`: (N, K / 256 * 210) uint8, the GGUF tensor's rows as the file holds them;
    float32 logits, as `Int8HeadLinear` gives."""

    bits = 6
    group = GROUP

    @staticmethod
    def takes(head: nn.Module, ggml_type: int) -> bool:
        """A head without a bias, of a type and width this kernel reads."""
        return isinstance(head, nn.Linear) and head.bias is None \
            and int(ggml_type) == Q6_K and int(head.in_features) % 256 == 0

    def __init__(self, head: nn.Linear, blocks: torch.Tensor) -> None:
        super().__init__(head)
        self.ggml_type = Q6_K
        self.register_buffer("blocks", blocks)

    def whole(self) -> bool:
        """Whether its blocks are those of (out_features, in_features) values."""
        blocks = getattr(self, "blocks", None)  # a packed file's shell may lack them
        shape = (self.out_features, self.in_features // 256 * BLOCK_BYTES)
        return isinstance(blocks, torch.Tensor) and blocks.dtype == torch.uint8 \
            and tuple(blocks.shape) == shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self._mm(x.reshape(-1, shape[-1]))
        return out.reshape(*shape[:-1], self.out_features)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":  # on a GPU: a bfloat16 copy (`gpu_weights.place_on_gpu`)
            return nn.functional.linear(x.to(_BF16), self.get_buffer("dense_weight")).float()
        from kvchat.models.head_kernels import q6k_head_mm

        return q6k_head_mm(x, self.get_buffer("blocks"), self.in_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 weight rows `ids` (any shape): (*ids.shape, K)."""
        return block_rows(self.get_buffer("blocks"), ids, Q6_K, self.in_features)

    def dequantized(self, device: torch.device | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (N, K) weight in `dtype` on `device` (default: float32 where the blocks are),
        no float32 copy of the whole held (`block_table`)."""
        return block_table(self.get_buffer("blocks"), Q6_K, self.in_features, device, dtype)
