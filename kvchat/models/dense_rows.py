"""Dense (float) linear layers that compute each row alone: what keeps a float model's forward
batch-invariant on CPU, as the quantized kernels are by construction (kvchat.models.quant)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

ROW_BLOCK = 16  # rows per dense matmul call under `fix_dense_rows`


class RowBlockLinear(nn.Linear):
    """A dense (float) linear layer that multiplies its input ROW_BLOCK rows at a time, the last
    block padded with zero rows: every call has one shape, so the GEMM library takes one kernel
    and one order of sums for every row, whether the forward holds 1 row (a decode step) or 512
    (a prefill chunk). A plain call lets it pick a GEMV for one row and a blocked GEMM for many,
    and their float32 results differ in the last bits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        m = rows.shape[0]
        pad = -m % ROW_BLOCK
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        if rows.shape[0] == ROW_BLOCK:
            out = nn.functional.linear(rows, self.weight, self.bias)
        else:
            out = torch.cat([nn.functional.linear(rows[lo : lo + ROW_BLOCK], self.weight,
                                                  self.bias)
                             for lo in range(0, rows.shape[0], ROW_BLOCK)])
        return out[:m].view(*x.shape[:-1], self.out_features)


def fix_dense_rows(model: Any) -> None:
    """Make every dense linear layer of a model on CPU a RowBlockLinear (in place, sharing its
    weight). Quantized layers compute each row alone already."""
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu":
            module.__class__ = RowBlockLinear
