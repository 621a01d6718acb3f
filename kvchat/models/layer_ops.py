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
from typing import Any, NamedTuple

import torch

from kvchat.models.native import library

LLAMA_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm",
                         "Phi3RMSNorm"})
GEMMA_NORMS = frozenset({"Gemma2RMSNorm", "Gemma3RMSNorm"})
_DTYPES = (torch.float32, torch.bfloat16)


class NormWeight(NamedTuple):
    """A norm as layer_ops.c runs it: the modules' own weights, read at every call (an edited
    weight is seen), eps and formula. Per-head rows (a q and a k norm over one qkv output): heads
    below `split` take `weight`, the rest `other`."""

    weight: torch.Tensor
    eps: float
    gemma: bool
    other: torch.Tensor | None = None
    split: int = 0

    def torch_weight(self, heads: int | None = None) -> torch.Tensor:
        """What the module's own forward multiplies by (Llama's weight in its dtype, Gemma's
        1 + weight in float32), one row per head when `heads`."""
        weight = self.weight.detach()
        if heads is not None:
            rows = [weight.expand(self.split, -1)]
            if self.other is not None:
                rows.append(self.other.detach().expand(heads - self.split, -1))
            weight = torch.cat(rows)
        return 1.0 + weight.float() if self.gemma else weight


def norm_weight(module: Any, other: Any = None, split: int = 0) -> NormWeight | None:
    """The norm of `module` (with `other`: per-head rows, heads below `split` taking `module`'s
    weight; both of one class and eps), or None for a norm kvchat does not know."""
    modules = [module] if other is None else [module, other]
    kinds = {type(m).__name__ for m in modules}
    eps = {float(getattr(m, "variance_epsilon", getattr(m, "eps", 0.0))) for m in modules}
    weights = [getattr(m, "weight", None) for m in modules]
    if len(kinds) != 1 or len(eps) != 1 or not kinds <= LLAMA_NORMS | GEMMA_NORMS:
        return None
    if not all(isinstance(w, torch.Tensor) and w.dim() == 1 for w in weights):
        return None
    assert isinstance(weights[0], torch.Tensor)
    return NormWeight(weights[0], eps.pop(), kinds <= GEMMA_NORMS,
                      None if other is None else weights[1], split)


class _NativeForward:
    """A norm module's forward on layer_ops.c (installed as its `forward`): its dtypes, its
    formula, kvchat's reduction; the class's own forward off CPU or for other dtypes. An object,
    not a bound function, so that a model holding it still pickles (`torch.save`)."""

    def __init__(self, module: Any) -> None:
        found = norm_weight(module)
        assert found is not None
        self.module, self.eps, self.gemma = module, found.eps, found.gemma

    @torch.compiler.disable  # a C call: outside a compiled graph, as the int4 kernel is
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        norm = NormWeight(module.weight, self.eps, self.gemma)
        out_dtype = x.dtype if self.gemma else torch.promote_types(norm.weight.dtype, x.dtype)
        if not runs_natively(x, norm, out_dtype):
            return type(module).forward(module, x)
        return rms_norm(x, norm, out_dtype)


def is_native(module: Any) -> bool:
    """Whether `module`'s forward is kvchat's native norm (`native_norms`)."""
    return isinstance(module.__dict__.get("forward"), _NativeForward)


def native_norms(model: Any) -> int:
    """Install the native RMSNorm on every norm module of `model` it knows (see the module doc);
    the number installed. Idempotent; none where the native library is not built."""
    if library() is None:
        return 0
    count = 0
    for module in model.modules():
        if is_native(module) or norm_weight(module) is None:
            continue
        module.forward = _NativeForward(module)
        count += 1
    return count


def between_kernels(model: Any) -> None:
    """What a quantized model runs between its weight kernels: the float32 residual stream
    (`residual.float32_residual`), then the native norms."""
    from kvchat.models.residual import float32_residual

    float32_residual(model)
    native_norms(model)


def runs_natively(x: torch.Tensor, norm: NormWeight, out_dtype: torch.dtype) -> bool:
    """Whether `rms_norm` takes these (CPU, float32 / bfloat16 x, weights and out; a q / k
    pair of one dtype and shape); the module's own forward runs the rest."""
    weight, other = norm.weight, norm.other
    return (x.is_cpu and x.dtype in _DTYPES and out_dtype in _DTYPES and weight.is_cpu
            and weight.dtype in _DTYPES
            and (other is None or (other.is_cpu and other.dtype == weight.dtype
                                   and other.shape == weight.shape)))


def norm_flags(x_dtype: torch.dtype, weight_dtype: torch.dtype, gemma: bool,
               out_dtype: torch.dtype) -> int:
    """layer_ops.c's flags argument (X_BF16 ... OUT_BF16) for a norm of these dtypes."""
    bf16 = torch.bfloat16
    return (int(x_dtype == bf16) | int(weight_dtype == bf16) << 1 | int(gemma) << 2
            | int(not gemma and x_dtype == bf16) << 3 | int(out_dtype == bf16) << 4)


def rms_norm(x: torch.Tensor, norm: NormWeight, out_dtype: torch.dtype,
             heads: int | None = None, checked: bool = False, isa: int = -1
             ) -> torch.Tensor:
    """layer_ops.c's RMSNorm of x's last dim, out in `out_dtype` (float32 or bfloat16). With
    `heads`, x is (M, heads * n) (a slice of wider rows is read in place) whose rows are heads of
    n values, head h taking `norm.weight` below `norm.split` and `norm.other` from it on (a q and
    a k norm); out (M, heads, n). Raises ValueError on shapes, dtypes or devices it cannot run
    (`checked`: the caller has asked `runs_natively`). `isa` caps the copy that runs (tests:
    0 plain C, 1 AVX2, -1 this CPU's widest; they give the same bits)."""
    n = int(norm.weight.shape[-1])
    if not checked and not runs_natively(x, norm, out_dtype):
        raise ValueError(f"rms_norm: runs float32 / bfloat16 on CPU, not {x.dtype} on "
                         f"{x.device.type} to {out_dtype} with a {norm.weight.dtype} weight")
    width = n if heads is None else heads * n
    if x.dim() == 0 or x.shape[-1] != width or (heads is not None and norm.other is None
                                                and norm.split < heads):
        raise ValueError(f"rms_norm: rows of {width} values, not {tuple(x.shape)}"
                         + ("" if heads is None else f" ({heads} heads of {n})"))
    if heads is None:
        x = x.contiguous()
        shape: tuple[int, ...] = tuple(x.shape)
        rows, outer, per, split = x.numel() // n, n, 1, 1
    else:
        if x.dim() != 2 or x.stride(-1) != 1 or x.stride(0) < width:
            x = x.reshape(-1, width).contiguous()
        shape = (x.shape[0], heads, n)
        rows, outer, per, split = x.shape[0] * heads, x.stride(0), heads, norm.split
    weight = norm.weight if norm.weight.is_contiguous() else norm.weight.contiguous()
    other = norm.other if norm.other is not None else weight
    other = other if other.is_contiguous() else other.contiguous()
    out = torch.empty(shape, dtype=out_dtype)
    flags = norm_flags(x.dtype, weight.dtype, norm.gemma, out_dtype)
    flags |= (isa + 1 if isa in (0, 1) else 0) << 5  # layer_ops.c's ISA_CAP
    rc = library().kvchat_rms_norm(  # type: ignore[union-attr]
        x.data_ptr(), outer, per, weight.data_ptr(), other.data_ptr(), split, rows, n,
        ctypes.c_float(norm.eps), flags, out.data_ptr(), torch.get_num_threads())
    if rc == -2:
        raise MemoryError("rms_norm: no memory for the weight row")
    if rc != 0:
        raise ValueError(f"rms_norm: bad shape {tuple(x.shape)} for a norm over {n}")
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_pos_emb`'s arithmetic on bfloat16: x (B, Q, H, D) with D contiguous, cos /
    sin (B or 1, Q, R), R <= D rotating the first R dims (Phi-3's partial rotary); out
    (B, H, Q, D), contiguous. Raises ValueError on shapes, dtypes or devices it cannot run."""
    bf16 = torch.bfloat16
    if (x.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape or x.dtype != bf16
            or cos.dtype != bf16 or sin.dtype != bf16
            or not (x.is_cpu and cos.is_cpu and sin.is_cpu)):
        raise ValueError(f"rotary: bfloat16 CPU x (B, Q, H, D) and cos / sin (B, Q, R), not "
                         f"{tuple(x.shape)} {x.dtype}, {tuple(cos.shape)} {cos.dtype}, "
                         f"{tuple(sin.shape)} {sin.dtype}")
    b, q, heads, d = x.shape
    r = int(cos.shape[-1])
    if cos.shape[0] not in (1, b) or cos.shape[1] != q or r > d or r % 2:
        raise ValueError(f"rotary: cos / sin {tuple(cos.shape)} do not fit x {tuple(x.shape)}")
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
