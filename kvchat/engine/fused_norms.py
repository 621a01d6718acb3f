"""The fused decode forward's norms (`fused_decode`): a decoder's RMSNorm modules as that
forward runs them, on kvchat's native norm (`layer_ops`) where the modules run it, else the
family's torch arithmetic."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from kvchat.models.layer_ops import NormWeight, is_native, norm_weight, runs_natively
from kvchat.models.layer_ops import rms_norm as native_rms_norm


class Norm(NamedTuple):
    modules: tuple[Any, ...]  # the norm module, or the q norm's and the k norm's
    eps: float
    gemma: bool
    heads: int | None  # per-head rows (q and k norms over the qkv output): how many
    split: int  # heads below it take the first module's weight
    native: bool  # the modules run kvchat's native norm (`layer_ops`)
    held: list[NormWeight]  # the last `weights()`, kept while the modules hold those tensors

    def weights(self) -> NormWeight:
        """The modules' weights as they are now (edited in place or through `.data`: the
        kernel reads them at each call; replaced by another Parameter: taken again). Read from
        each module's parameter dict: `module.weight` costs a __getattr__ call a norm."""
        held, modules = self.held, self.modules
        if held:
            found = held[0]
            if modules[0]._parameters.get("weight") is found.weight and (
                    len(modules) == 1 or modules[1]._parameters.get("weight") is found.other):
                return found
        other = modules[1].weight if len(modules) > 1 else None
        found = NormWeight(modules[0].weight, self.eps, self.gemma, other, self.split)
        held[:] = [found]
        return found


def norm(module: Any, other: Any = None, heads: int | None = None, split: int = 0
         ) -> Norm | None:
    """The norm `module` runs (with `other` and `heads`: per-head rows, the first `split` heads
    taking `module`'s weight, the rest `other`'s), or None for a norm this forward does not know.
    Modules running kvchat's native norm are run by it here too (all of them or none)."""
    found = norm_weight(module, other, split)
    native = {is_native(m) for m in (module, other) if m is not None}
    if found is None or len(native) != 1:
        return None
    modules = (module,) if other is None else (module, other)
    return Norm(modules, found.eps, found.gemma, heads, split, native.pop(), [])


def qk_norm(attn: Any, heads: int, kv_heads: int) -> Norm | None | bool:
    """The q / k norms as one norm over heads + kv_heads rows, None when the attention has none,
    False when it has norms this forward does not know."""
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if q_norm is None and k_norm is None:
        return None
    if q_norm is None or k_norm is None:
        return False
    found = norm(q_norm, k_norm, heads + kv_heads, heads)
    return False if found is None else found


def rms_norm(x: torch.Tensor, norm: Norm, to_bf16: bool = False) -> torch.Tensor:
    """The family's RMSNorm: float32 x * rsqrt(mean(x^2) + eps) (`torch.rms_norm` runs the same
    arithmetic in one call), then Llama's cast back and times the weight, or Gemma's times
    (1 + weight) in float32 and cast back; or kvchat's native norm where the model's modules run
    it. `to_bf16`: the result as the weight kernels' bfloat16 input (the same bits as casting
    it after). A per-head norm (q / k norms, `norm.heads`): x is (rows, heads * d), out
    (rows, heads, d)."""
    weights = norm.weights()
    out_dtype = torch.bfloat16 if to_bf16 else x.dtype if weights.gemma else \
        torch.promote_types(weights.weight.dtype, x.dtype)
    if norm.native and runs_natively(x, weights, out_dtype):
        return native_rms_norm(x, weights, out_dtype, norm.heads, checked=True)
    weight = weights.torch_weight(norm.heads)
    shape = (int(weight.shape[-1]),)
    if norm.heads is not None:
        x = x.reshape(x.shape[0], norm.heads, -1)
    if weights.gemma:
        return (torch.rms_norm(x.float(), shape, eps=weights.eps) * weight).to(x.dtype)
    return weight * torch.rms_norm(x.float(), shape, eps=weights.eps).to(x.dtype)
