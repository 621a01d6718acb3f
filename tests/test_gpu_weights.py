"""Packed weights bound for a GPU, checked where there is none: the int4 grid a CPU layer holds
comes back exactly for torch's CUDA layout, and the plan and precision a GPU gets."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvchat.engine.forward_plan import choose_forward
from kvchat.models import gpu_weights, precision
from kvchat.models.quant import Int4Linear, pack_int4, quantize_int4, unpack_int4


@pytest.mark.parametrize("k", [64, 96, 576])  # an even and an odd number of 32-column groups
def test_nibbles_unpack_to_the_grid(k: int) -> None:
    q = torch.randint(0, 16, (48, k), generator=torch.Generator().manual_seed(k),
                      dtype=torch.int32)
    scales = torch.randn(48, k // 32).to(torch.float16)
    zeros = torch.randn(48, k // 32).to(torch.float16)
    back = unpack_int4(*pack_int4(q, scales, zeros))
    assert torch.equal(back[0].to(torch.int32), q)
    assert torch.equal(back[1], scales) and torch.equal(back[2], zeros)


def test_grid_of_a_layer_is_the_grid_it_multiplies_by() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 32, bias=False)
    layer = Int4Linear(linear)
    grid = gpu_weights.grid_of(layer)
    want = quantize_int4(linear.weight)
    if layer.native:  # kvchat's layout holds the grid itself
        assert torch.equal(grid.q, want.q) and torch.equal(grid.scales, want.scales)
        assert torch.equal(grid.zeros, want.zeros)
    values = grid.q.float() * grid.scales.float().repeat_interleave(32, 1) \
        + grid.zeros.float().repeat_interleave(32, 1)
    assert torch.allclose(values, layer.dequantized(), atol=1e-2)


def test_the_fused_cpu_forward_is_not_planned_on_a_gpu() -> None:
    plan = choose_forward("LlamaForCausalLM", "int4", "bfloat16", "cuda", native=True)
    assert plan.family is None and plan.attention == "sdpa" and not plan.invariant
    assert choose_forward("LlamaForCausalLM", "int4", "bfloat16", "cpu", native=True).fused


def test_int4_on_a_gpu_without_the_kernel_falls_back(monkeypatch) -> None:
    monkeypatch.setattr(gpu_weights, "int4_on_gpu", lambda device: False)
    chosen = precision.resolve_precision("int4", "cuda", None)
    assert chosen.name == "bfloat16" and "8.0" in chosen.why
    monkeypatch.setattr(gpu_weights, "int4_on_gpu", lambda device: True)
    assert precision.resolve_precision(None, "cuda", "int4").name == "int4"
    assert precision.resolve_precision("int8", "cuda", None).name == "bfloat16"
