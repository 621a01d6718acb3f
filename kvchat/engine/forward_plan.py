"""Which forward runs a model, decided in one place, with what it can do.

`choose_forward` maps what a model is and how it runs - its architecture (the family), the
precision its weights run at and the compute dtype, the device, the eviction policy (H2O ranks
blocks by the attention mass each forward reports) and `--compile` - to a `ForwardPlan`:
- `decode`: what runs decode steps and drafts: the fused forward of a family kvchat knows
  (`fused_decode.py`, under quantized weights) or transformers' own; `compiled`: batched steps
  through `torch.compile`;
- `attention`: kvchat's fixed-order kernel (`decode_attention.py`, CPU, bfloat16 or float32),
  SDPA (elsewhere), or an eager attention that reports mass (`attention.py`, H2O);
- the capabilities the engine reads instead of asking again: whether steps may carry drafts,
  whether a batch may hold its rows' common K/V once (a shared head), whether forwards report
  attention mass, and whether a sequence's bits are the same whatever else is in the forward
  (`invariant`, with the reasons when not).

`kvchat models` shows the plan from the config alone, before loading; `ModelRunner` takes the
same plan and `confirm`s it against the loaded model (a family's fused forward may not cover
every model of it, and MoE experts' batched matmuls are not row-alone). The chat banner names
the confirmed one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvchat.models.architectures import DECODER_FAMILIES

POLICIES_WITH_MASS = frozenset({"h2o"})
QUANTIZED = frozenset({"int4", "int8"})
FIXED, SDPA, EAGER_MASS = "fixed-order", "sdpa", "eager with mass"
_ATTENTION_NAMES = {
    FIXED: "kvchat's fixed-order attention",
    SDPA: "SDPA attention",
    EAGER_MASS: "eager attention reporting mass (H2O)",
}


@dataclass(frozen=True)
class ForwardPlan:
    family: str | None  # the fused forward's family, when it runs decode steps
    precision: str  # of the weights: int4, int8 or a float dtype name
    compute: str  # activations and K/V
    residual: str  # the residual stream's dtype (float32 under quantized weights, for a family)
    device: str
    attention: str  # FIXED, SDPA or EAGER_MASS
    compiled: bool  # batched decode steps through torch.compile
    drafts: bool  # a decode step may carry draft columns
    shared_head: bool  # a batch may hold its rows' common K/V once
    attention_mass: bool  # forwards report attention mass per key (H2O)
    limits: tuple[str, ...]  # what keeps a batch from changing no bit; () when nothing does
    native_layers: int = 0  # of the fused forward's layers, those that run a lone row's new
    # token in one native call (`native_layer.py`): the same bits, fewer Python calls

    @property
    def fused(self) -> bool:
        return self.family is not None

    @property
    def invariant(self) -> bool:
        return not self.limits

    def describe(self) -> str:
        """One line for the chat banner and `kvchat models`."""
        forward = f"fused {self.family} forward" if self.family else "transformers' forward"
        if self.family and self.native_layers:
            forward += f" ({self.native_layers} layers one native call a token)"
        if self.compiled:
            forward += ", batched steps compiled"
        exact = "batch-invariant" if self.invariant else \
            f"a batch can round a logit differently ({', '.join(self.limits)})"
        return f"{forward} · {_ATTENTION_NAMES[self.attention]} · {exact}"


def choose_forward(architecture: str, precision: str, compute: str, device: str,
                   policy: str | None = None, compiled: bool = False,
                   sliding: bool = False, native: bool | None = None) -> ForwardPlan:
    """The forward for a model of `architecture` (its class name, or a GGUF's family name)
    at `precision` / `compute` on `device` (cpu, cuda, mps), under eviction `policy`,
    `compiled` or not; `sliding`: some layers attend through a window; `native`: kvchat's
    native library is built here (None: look)."""
    if native is None:
        from kvchat.models.native import attention_native

        native = attention_native()
    mass = policy in POLICIES_WITH_MASS
    known = DECODER_FAMILIES.get(architecture) or \
        (architecture if architecture in DECODER_FAMILIES.values() else None)
    # the fused forward calls kvchat's CPU kernels
    family = known if precision in QUANTIZED and not mass and device == "cpu" else None
    fixed = device == "cpu" and compute in ("bfloat16", "float32") and native
    attention = EAGER_MASS if mass else FIXED if fixed else SDPA
    limits = []
    if not fixed:
        limits.append(f"on {device}" if device != "cpu" else
                      "no native library" if not native else f"{compute} compute")
    if mass:
        limits.append("H2O's forwards")
    if compiled:
        limits.append("--compile")
    quantized_family = precision in QUANTIZED and known is not None
    return ForwardPlan(
        family=family, precision=precision, compute=compute,
        residual="float32" if quantized_family else compute, device=device,
        attention=attention, compiled=compiled, drafts=not mass,
        shared_head=family is not None and not compiled and not sliding,
        attention_mass=mass, limits=tuple(limits))


def confirm(plan: ForwardPlan, fused_heads: bool | None, attends_natively: bool,
            rows_alone: bool, native_layers: int = 0) -> ForwardPlan:
    """`plan` as the loaded model allows it. `fused_heads`: whether its fused forward was built
    and takes a shared head (None: not built, a layer it does not know; False: sliding layers,
    whose window would reach into the head); `attends_natively`: its attention was switched to
    kvchat's; `rows_alone`: no weight's matmul mixes rows (MoE experts do); `native_layers`:
    the fused forward's layers that run in one native call."""
    limits = list(plan.limits)
    if plan.family is not None and fused_heads is None:
        plan = replace(plan, family=None)
    shared = plan.shared_head and bool(fused_heads)
    if plan.attention == FIXED and not attends_natively:
        plan = replace(plan, attention=SDPA)
        limits.append("the model's own attention")
    if not rows_alone:
        limits.append("matmuls that mix rows")
    return replace(plan, shared_head=shared, limits=tuple(limits),
                   native_layers=native_layers if plan.family is not None else 0)


def compiled(plan: ForwardPlan) -> ForwardPlan:
    """`plan` once batched decode steps run through torch.compile: they fuse small ops, so they
    round differently from the eager steps, and only the fused forward reads a shared head."""
    return replace(plan, compiled=True, shared_head=False, limits=(*plan.limits, "--compile"),
                   native_layers=0)


def plan_of(model: Any, precision: str, compute: str, device: str,
            policy: str | None) -> ForwardPlan:
    """`choose_forward` for a loaded model (not compiled: `compiled` says when it is)."""
    return choose_forward(type(model).__name__, precision, compute, device, policy)
