"""The output head's kernels (int8_head.c, block_head.c; built and loaded by `native`): the int8
head's and the Q6_K head's matmuls, and without the library their torch sums (float32, one
activation row at a time, a fixed chunk of weight rows at a time: slower, and their bits are
their own)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvchat.models import native

if TYPE_CHECKING:
    import torch

_FALLBACK_ROWS = 16384  # weight rows de-quantized at a time by the torch path


def int8_head_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int,
                 isa: int = -1) -> torch.Tensor:
    """(M, K) activations times the (N, K) int8 weight whose groups of `group` columns share a
    float32 scale ((N, K / group)): (M, N) float32. `isa` caps the instruction set (tests)."""
    import torch

    xf = x.float().contiguous()
    m, k = xf.shape
    n = q.shape[0]
    lib = native.library() if x.device.type == "cpu" else None
    if lib is None:
        return _torch_mm(xf, q, scales, group)
    out = torch.empty(m, n, dtype=torch.float32)
    rc = lib.kvchat_int8_head_mm(q.data_ptr(), scales.data_ptr(), xf.data_ptr(),
                                 out.data_ptr(), m, n, k, group, torch.get_num_threads(), isa)
    if rc == -2:
        raise MemoryError("int8 head: no memory for the activations' integers")
    if rc != 0:
        raise ValueError(f"int8 head: no kernel for K={k}, group={group}")
    return out


def q6k_head_mm(x: torch.Tensor, blocks: torch.Tensor, k: int, isa: int = -1) -> torch.Tensor:
    """(M, K) activations times the (N, K) weight held as Q6_K `blocks` ((N, K / 256 * 210)
    bytes): (M, N) float32, block_head.c's integer sums (each activation block of 256 on a
    16-bit grid of its own). Without the library, `int8_head_mm`'s torch sum in float32 over
    the same weights (close to the kernel's, not its bits)."""
    import torch

    xf = x.float().contiguous()
    m = xf.shape[0]
    if xf.shape[1] != k or k % 256:
        raise ValueError(f"Q6_K head: no kernel for K={xf.shape[1]} (a multiple of 256, {k})")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != k // 256 * 210 \
            or not blocks.is_contiguous():
        raise ValueError(f"Q6_K head: blocks of shape {tuple(blocks.shape)} for K={k}")
    n = blocks.shape[0]
    if x.device != blocks.device:
        raise ValueError(f"Q6_K head: activations on {x.device}, blocks on {blocks.device}")
    if n == 0:
        return torch.empty(m, 0, dtype=torch.float32, device=x.device)
    lib = native.library() if x.device.type == "cpu" else None
    if lib is None:  # `_torch_mm`'s sum over the same weights
        return _rows_mv(xf, n, lambda lo, hi: q6k_values(blocks[lo:hi]))
    out = torch.empty(m, n, dtype=torch.float32)
    rc = lib.kvchat_q6k_head_mm(blocks.data_ptr(), xf.data_ptr(), out.data_ptr(), m, n, k,
                                torch.get_num_threads(), isa)
    if rc == -2:
        raise MemoryError("Q6_K head: no memory for the activations' integers")
    if rc != 0:
        raise ValueError(f"Q6_K head: no kernel for K={k}")
    return out


def q6k_values(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K rows ((N, K / 256 * 210) uint8) as float32 (N, K) in torch ops: gguf-py's
    `dequantize` op for op (float32(d * sc) * (q - 32)), on torch's threads."""
    import torch

    b = blocks.reshape(-1, 210)
    low = (b[:, :128].reshape(-1, 2, 1, 64)
           >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 15
    high = (b[:, 128:192].reshape(-1, 2, 1, 32)
            >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3
    q = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)).to(torch.int8) - 32
    scale = b[:, 208:210].contiguous().view(torch.float16).float() \
        * b[:, 192:208].contiguous().view(torch.int8).float()
    values = scale.reshape(-1, 16, 1) * q.reshape(-1, 16, 16).float()
    return values.reshape(blocks.shape[0], -1)


def int8_group_values(q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """float32 q * scale, `quant.quantize_int8_groups`' inverse: (..., K) from (..., K) int8 and
    (..., K / group) scales."""
    k = q.shape[-1]
    grouped = q.float().view(*q.shape[:-1], k // group, group) * scales[..., None]
    return grouped.view(q.shape)


def _torch_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
              group: int) -> torch.Tensor:
    """The same sum in torch, each row alone so that no row's bits depend on the others."""
    return _rows_mv(x, q.shape[0],
                    lambda lo, hi: int8_group_values(q[lo:hi], scales[lo:hi], group))


def _rows_mv(x: torch.Tensor, n: int, weights: Callable[[int, int], torch.Tensor]
             ) -> torch.Tensor:
    """x (M, K) times the (n, K) float32 weight `weights(lo, hi)` gives a chunk of rows of at a
    time, one activation row at a time: (M, n) float32."""
    import torch

    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    for lo in range(0, n, _FALLBACK_ROWS):
        hi = min(n, lo + _FALLBACK_ROWS)
        w = weights(lo, hi)
        for row in range(x.shape[0]):
            out[row, lo:hi] = torch.mv(w, x[row])
    return out
