"""A decoder's small per-layer ops on kvchat's native kernel (layer_ops.c): RMSNorm and the rotary
embedding, one call each where torch runs several (a decode step on CPU spends as long in those
calls as in the weight kernels).

RMSNorm is kvchat's own definition (layer_ops.c: the sum of squares in double, in a fixed order):
`native_norms(model)` installs it on a quantized model's RMSNorm modules, and the fused decode
forward calls the same function, so the model's own forward (prefill, and the reference the
tests hold the fused forward to) and the fused one keep giving the same bits, on any machine.
Each module keeps its formula (Llama's `w * norm(x)` cast back to the input's dtype, Gemma's
`norm(x) * (1 + w)` in float32) and its dtypes. A norm on another device or dtype runs its
original forward. The rotary embedding is torch's own arithmetic, bit for bit (tests hold it to
transformers' `apply_rotary_pos_emb`), so nothing else needs to change for it.
"""

from __future__ import annotations

import ctypes
import types
from typing import Any, NamedTuple

import torch

from kvchat.models.native import library

LLAMA_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm",
                         "Phi3RMSNorm"})
GEMMA_NORMS = frozenset({"Gemma2RMSNorm", "Gemma3RMSNorm"})
_ATTRIBUTE = "_kvchat_native_norm"  # on a norm module: its original forward, once installed
_DTYPES = (torch.float32, torch.bfloat16)


class NormWeight(NamedTuple):
    """What layer_ops.c multiplies by: (rows, n) float32 (Llama's weight, Gemma's 1 + weight;
    several rows for a q / k norm stacked per head), and the module's formula."""

    weight: torch.Tensor
    eps: float
    gemma: bool


def norm_weight(*modules: Any) -> NormWeight | None:
    """The norm of `modules` (one class and eps; several: their weights stacked as rows), or None
    for a norm kvchat does not know."""
    kinds = {type(m).__name__ for m in modules}
    eps = {float(getattr(m, "variance_epsilon", getattr(m, "eps", 0.0))) for m in modules}
    if len(kinds) != 1 or len(eps) != 1 or not kinds <= LLAMA_NORMS | GEMMA_NORMS:
        return None
    gemma = kinds <= GEMMA_NORMS
    weight = torch.stack([m.weight.detach().float() for m in modules])
    return NormWeight(1.0 + weight if gemma else weight, eps.pop(), gemma)


def is_native(module: Any) -> bool:
    """Whether `module`'s forward is kvchat's native norm (`native_norms`)."""
    return _ATTRIBUTE in module.__dict__


def native_norms(model: Any) -> int:
    """Install the native RMSNorm on every norm module of `model` it knows (see the module doc);
    the number installed. Idempotent; none where the native library is not built."""
    if library() is None:
        return 0
    count = 0
    for module in model.modules():
        if is_native(module) or norm_weight(module) is None:
            continue
        module.__dict__[_ATTRIBUTE] = module.forward
        module.forward = types.MethodType(_native_forward, module)
        count += 1
    return count


def between_kernels(model: Any) -> None:
    """What a quantized model runs between its weight kernels: the float32 residual stream
    (`residual.float32_residual`), then the native norms."""
    from kvchat.models.residual import float32_residual

    float32_residual(model)
    native_norms(model)


def _native_forward(module: Any, x: torch.Tensor) -> torch.Tensor:
    """The module's forward on layer_ops.c: its dtypes, its formula, kvchat's reduction."""
    gemma = type(module).__name__ in GEMMA_NORMS
    out_dtype = x.dtype if gemma else torch.promote_types(module.weight.dtype, x.dtype)
    if x.device.type != "cpu" or x.dtype not in _DTYPES or out_dtype not in _DTYPES:
        return module.__dict__[_ATTRIBUTE](x)
    weight = module.__dict__.get("_kvchat_norm_weight")
    stamp = (module.weight._version, module.weight.data_ptr())
    if weight is None or weight[0] != stamp:  # computed again if the weight has changed
        weight = (stamp, norm_weight(module))
        module.__dict__["_kvchat_norm_weight"] = weight
    return rms_norm(x, weight[1], out_dtype)


def rms_norm(x: torch.Tensor, norm: NormWeight, out_dtype: torch.dtype,
             heads: int | None = None) -> torch.Tensor:
    """layer_ops.c's RMSNorm of x's last dim, out in `out_dtype` (float32 or bfloat16). With
    `heads`, x is (M, heads * n) (a slice of wider rows is read in place) whose rows are heads of
    n values, head h taking row h of the norm's weight (a q / k norm); out (M, heads, n)."""
    n = int(norm.weight.shape[-1])
    w_rows = int(norm.weight.shape[0])
    if heads is None:
        x = x.contiguous()
        shape: tuple[int, ...] = tuple(x.shape)
        rows, outer, per = x.numel() // n, n, 1
    else:
        if x.dim() != 2 or x.stride(-1) != 1 or x.stride(0) < heads * n:
            x = x.reshape(-1, heads * n).contiguous()
        shape = (x.shape[0], heads, n)
        rows, outer, per = x.shape[0] * heads, x.stride(0), heads
    out = torch.empty(shape, dtype=out_dtype)
    rc = library().kvchat_rms_norm(  # type: ignore[union-attr]
        x.data_ptr(), int(x.dtype == torch.bfloat16), outer, per, norm.weight.data_ptr(), w_rows,
        rows, n, ctypes.c_float(norm.eps), int(not norm.gemma and x.dtype == torch.bfloat16),
        out.data_ptr(), int(out_dtype == torch.bfloat16), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"rms_norm: bad shape {tuple(x.shape)} for a norm over {n}")
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_pos_emb`'s arithmetic on bfloat16: x (B, Q, H, D) with D contiguous, cos /
    sin (B or 1, Q, R), R <= D rotating the first R dims (Phi-3's partial rotary); out
    (B, H, Q, D), contiguous."""
    b, q, heads, d = x.shape
    r = int(cos.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    cs = (ctypes.c_long * 2)(cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1))
    xs = (ctypes.c_long * 3)(*x.stride()[:3])
    out = torch.empty(b, heads, q, d, dtype=torch.bfloat16)
    rc = library().kvchat_rotary(  # type: ignore[union-attr]
        x.data_ptr(), xs, cos.data_ptr(), sin.data_ptr(), cs, b, q, heads, d, r, out.data_ptr())
    if rc != 0:
        raise ValueError(f"rotary: bad shapes {tuple(x.shape)} and {tuple(cos.shape)}")
    return out
