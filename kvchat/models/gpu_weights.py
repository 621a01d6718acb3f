"""Packed weights on a CUDA GPU: a model loaded and packed on CPU, moved to the device packed.

A GGUF (or a float model at `--dtype int4`) is read and packed on CPU as everywhere
(`gguf_weights`, `packed_weights`: the same file, the same grids). `place_on_gpu` then moves it:
- each int4 layer goes to torch's CUDA int4 kernel (`_weight_int4pack_mm`, "tinygemm"): the
  same 4-bit values and groups of 32, its scales and zeros rounded to bfloat16 as torch's CPU
  layout rounds them (w = (q - 8) * scale + zero). Resident: half a byte per weight plus the
  scales, as on CPU. The kernel computes each output row from its own input row (one
  configuration whatever the rows), so a row's bits do not depend on the batch;
- torch has no CUDA int8 weight kernel, so an int8 layer (a shape int4 cannot take, or every
  layer at `--dtype int8`) runs its dequantized weight in bfloat16, and the int8 output head
  keeps its int8 rows (a tied embedding reads them) beside a bfloat16 copy the logits come
  from; a head kept as Q6_K blocks becomes that copy alone;
- everything else (norms, embeddings, biases) moves as it is.

The fused forward and kvchat's attention kernel are CPU code: on a GPU transformers' forward
runs with SDPA (`forward_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvchat.models.block_head import BlockHeadLinear
from kvchat.models.quant import (
    GROUP,
    Int4Grid,
    Int4Linear,
    Int8HeadLinear,
    Int8Linear,
    QuantLinear,
    quantize_int4,
    torch_int4_scales,
    unpack_int4,
)
from kvchat.models.quant_embeddings import BlockEmbedding

_BF16 = torch.bfloat16
_MIN_CAPABILITY = (8, 0)  # tinygemm's bfloat16 mma instructions: Ampere and later


def int4_on_gpu(device: str) -> bool:
    """Whether int4 layers run packed on `device`: a CUDA GPU of compute capability 8.0 or
    later, where torch has its int4 kernel."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return False
    index = torch.device(device).index
    capability = torch.cuda.get_device_capability(index or 0)
    return capability >= _MIN_CAPABILITY and hasattr(torch.ops.aten, "_weight_int4pack_mm")


def grid_of(layer: Int4Linear) -> Int4Grid:
    """The 4-bit grid `layer` multiplies by. kvchat's layout holds it as it is; torch's CPU
    layout is opaque, so its dequantized weight is gridded again (the same values, up to the
    bfloat16 rounding that layout already applied to the scales and zeros)."""
    if layer.native:
        q, scales, zeros = unpack_int4(layer.get_buffer("qweight"), layer.get_buffer("scales"),
                                       layer.get_buffer("zeros"))
        return Int4Grid(q.to(torch.int32), scales, zeros)
    return quantize_int4(layer.dequantized())


class CudaInt4Linear(QuantLinear):
    """An int4 layer on a CUDA GPU: torch's packed layout and (K / 32, N, 2) bfloat16 scales
    and zeros."""

    bits = 4

    def __init__(self, layer: Int4Linear, device: torch.device) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.bias = None if layer.bias is None else nn.Parameter(
            layer.bias.detach().to(device), requires_grad=False)
        self.group = GROUP
        grid = grid_of(layer)
        q = grid.q
        pairs = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).to(device)
        # inner k-tiles: the widest the input width allows (tinygemm needs K % (16 * tiles) == 0)
        self.tiles = next(t for t in (8, 4, 2) if self.in_features % (16 * t) == 0)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack(pairs,
                                                                                  self.tiles))
        self.register_buffer("scales_and_zeros", torch_int4_scales(grid).to(device))

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group,
                                                  self.scales_and_zeros)


class DenseLinear(QuantLinear):
    """An int8 layer on a device without an int8 weight kernel: its dequantized weight in
    bfloat16 (`QuantLinear`'s input and output dtypes kept)."""

    def __init__(self, layer: Int8Linear, device: torch.device) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.bias = None if layer.bias is None else nn.Parameter(
            layer.bias.detach().to(device), requires_grad=False)
        self.register_buffer("weight", layer.dequantized().to(device=device, dtype=_BF16))

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.get_buffer("weight"))


@dataclass(frozen=True)
class GpuPlacement:
    """What `place_on_gpu` did, per kind of layer."""

    int4_layers: int
    dense_layers: int  # int8 layers run dequantized in bfloat16
    head_dense: bool  # the int8 head computes its logits from a bfloat16 copy


def place(model: Any, quantized: bool, device: str) -> None:
    """Move a model loaded (and, `quantized`, packed) on CPU to `device`: a quantized one by
    `place_on_gpu`, anything else as it is; on "cpu", nothing to do."""
    if device == "cpu":
        return
    if quantized:
        place_on_gpu(model, device)
    else:
        model.to(device)


def place_on_gpu(model: Any, device: str) -> GpuPlacement:
    """Move `model`, packed on CPU, to the CUDA `device`, int4 layers in torch's CUDA layout
    (see the module doc)."""
    target = torch.device(device)
    counts = {"int4": 0, "dense": 0}
    head_dense = False
    for module in list(model.modules()):  # first: a tied one reads the head's CPU blocks
        if isinstance(module, BlockEmbedding):  # lookups on the device, no CPU
            module.to_table(target)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Int4Linear):
                setattr(parent, name, CudaInt4Linear(child, target))
                counts["int4"] += 1
            elif isinstance(child, Int8Linear):
                setattr(parent, name, DenseLinear(child, target))
                counts["dense"] += 1
            elif isinstance(child, BlockHeadLinear):  # de-quantized on CPU, where it is built
                dense = child.dequantized(target, _BF16)
                del child.blocks
                child.register_buffer("dense_weight", dense, persistent=False)
                head_dense = True
            elif isinstance(child, Int8HeadLinear):
                child.to(target)
                child.register_buffer("dense_weight",
                                      child.dequantized().to(_BF16), persistent=False)
                head_dense = True
    model.to(target)
    return GpuPlacement(counts["int4"], counts["dense"], head_dense)
