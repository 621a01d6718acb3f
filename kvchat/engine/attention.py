"""Attention that can report where its weight went: what the H2O policy ranks blocks by.

Fused kernels (SDPA, flash) never materialise the attention weights. `track_attention(model)`
registers, once per model, an attention implementation that runs the model's own kernel unless
the current forward asked for attention mass (`attention_mass()` below), and then runs an eager
attention that also sums, per key position, the weight it received. So the choice is made per
forward: a runner without H2O on the same model pays nothing, and nobody has to switch it back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvchat.errors import KvchatError

PREFIX = "kvchat_h2o"
_sink = threading.local()  # .rows: list of (B, K) mass tensors while a forward tracks


def _tracking() -> bool:
    return getattr(_sink, "rows", None) is not None


def _eager_with_mass(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Eager attention (with the logit soft-cap a model passes) that adds, per key position,
    the mass it received (summed over heads and queries) to the active sink. Scores, softmax
    and the weighted sum are float32 and the output is rounded once, as in the fixed-order
    kernel the other forwards run."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1).float()  # (B, H, K, D)
    value = value.repeat_interleave(groups, dim=1).float()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    weights = torch.matmul(query.float(), key.transpose(2, 3)) * scale  # (B, H, Q, K)
    softcap = kwargs.get("softcap")
    if softcap is not None:  # Gemma 2's, before the mask as its own attention applies it
        weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        weights = weights + attention_mask[:, :, :, : key.shape[-2]]
    weights = torch.softmax(weights, dim=-1)
    rows: list[torch.Tensor] | None = getattr(_sink, "rows", None)
    if rows is not None:
        rows.append(weights.sum(dim=(1, 2)))  # (B, K)
    out = torch.matmul(weights, value).to(query.dtype).transpose(1, 2).contiguous()
    return out, None  # (B, Q, H, D)


def _dispatch(base: Callable[..., Any] | None) -> Callable[..., Any]:
    """The base kernel, or the eager one while a forward tracks attention mass. A model whose
    base is plain eager (no registered kernel) always takes ours: it is eager too."""

    def attention(*args: Any, **kwargs: Any) -> Any:
        if base is None or _tracking():
            return _eager_with_mass(*args, **kwargs)
        return base(*args, **kwargs)

    return attention


def _dispatch_mask(base: Callable[..., Any]) -> Callable[..., Any]:
    def mask(*args: Any, **kwargs: Any) -> Any:
        return (eager_mask if _tracking() else base)(*args, **kwargs)

    return mask


class AttentionNotSwappable(KvchatError):
    """The model's attention cannot report its weights, so H2O would have nothing to rank by."""


def track_attention(model: Any) -> None:
    """Let forwards of `model` report attention mass on request. Idempotent."""
    if getattr(model, "_supports_attention_backend", True) is False:
        name = type(model).__name__
        raise AttentionNotSwappable(
            f"--policy h2o ranks blocks by the attention weights each forward reports, but "
            f"{name} computes attention in its own code, which kvchat cannot ask for them. Use "
            "--policy lru or sink-lru with this model.")
    current = str(model.config._attn_implementation or "eager")
    if current.startswith(PREFIX):
        return
    name = f"{PREFIX}:{current}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        base = ALL_ATTENTION_FUNCTIONS[current] if current in ALL_ATTENTION_FUNCTIONS else None
        AttentionInterface.register(name, _dispatch(base))
        masks: dict[str, Any] = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
        base_mask = masks.get(current, eager_mask)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, _dispatch_mask(base_mask))
    model.set_attn_implementation(name)


@contextmanager
def attention_mass(enabled: bool) -> Iterator[list[torch.Tensor] | None]:
    """While active (and enabled), forwards of tracked models append (B, K) attention mass per
    layer to the yielded list."""
    if not enabled:
        yield None
        return
    rows: list[torch.Tensor] = []
    _sink.rows = rows
    try:
        yield rows
    finally:
        _sink.rows = None
