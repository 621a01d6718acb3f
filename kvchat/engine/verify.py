"""Cached vs uncached equivalence on a real model: what `kvchat verify` reports.

For each prompt, on its own (the cache is emptied first, so an earlier prompt's blocks never
make the hit larger than it says): a cold run with the cache off, then warm runs through the
cache - after caching the first half of the prompt (a radix hit) and again (an exact repeat, whose
reply the cache then drafts) - a cold run in a batch beside two other sequences, and
transformers' own `generate` on the same model, each compared with the cold run token by token
and logit by logit. Greedy decoding, so any difference is a cache bug or rounding.

Where the runner's forward is batch-invariant (`ModelRunner.invariant`: the default on CPU) there
is no rounding to allow for: every comparison must be bitwise, logits included. Elsewhere (a GPU,
no native library, compiled steps, H2O's tracked forwards) a prompt computed in other chunks or
batch rows lands a few roundings differently: float32 runs agree to ~1e-5, bfloat16 activations
(and so int8 / int4 weights) round each logit to 8 significant bits. `tolerance` bounds that
drift there; a divergence is a tie when the reference scored the token the run picked no further
below its best than the drift already seen before (or one rounding step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvchat.config import SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.sequence import GenerationResult, Request


@dataclass(frozen=True)
class VerifyRow:
    prompt: str
    scenario: str  # "prefix hit" | "exact repeat" | "in a batch" | "plain generate"
    prompt_tokens: int
    hit_tokens: int
    source: str
    tokens_equal: bool
    first_divergence: int | None  # index into the generated tokens
    max_logit_diff: float
    generated: int
    tie: bool = False  # diverged at a tie within the precision's tolerance (see module doc)
    tolerance: float = 0.0
    draft_accepted: int = 0  # tokens the cache drafted and verification kept
    exact: bool = False  # compared bitwise: the forward is batch-invariant (no tolerance, no tie)

    @property
    def ok(self) -> bool:
        return self.max_logit_diff <= self.tolerance and (self.tokens_equal or self.tie)

    def as_dict(self) -> dict[str, object]:
        return {**self.__dict__, "ok": self.ok}


_RELATIVE_TOLERANCE = {"float32": 1e-5, "float16": 2.0**-8}  # others: bfloat16 compute
_BF16_TOLERANCE = 2.0**-4
_ROUNDING_STEP = {"float32": 1e-6, "float16": 2.0**-10}  # others: bfloat16, 2**-7 (a ulp or two)


class Comparison(NamedTuple):
    equal: bool  # same tokens
    first: int | None  # first divergent index into the generated tokens
    diff: float  # max |logit diff| up to and including it
    tolerance: float  # the logit difference this precision allows
    tie: bool  # diverged where the cold run scored the other token within tolerance of its best

    @property
    def ok(self) -> bool:
        return self.diff <= self.tolerance and (self.equal or self.tie)


def tolerance(precision: str, scale: float) -> float:
    """The logit difference rounding explains at `precision`, for logits up to |scale|."""
    return max(scale, 1.0) * _RELATIVE_TOLERANCE.get(precision, _BF16_TOLERANCE)


def compare(cold: GenerationResult, warm: GenerationResult,
            precision: str = "float32", exact: bool = False) -> Comparison:
    """Token by token and logit by logit (both runs need `record_logits`); `exact`: bitwise,
    with no tolerance and no tie."""
    a, b = cold.token_ids, warm.token_ids
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    la, lb = cold.step_logits or [], warm.step_logits or []
    upto = len(la) if first is None else first + 1
    diffs = [float((x - y).abs().max()) for x, y in zip(la[:upto], lb[:upto], strict=False)]
    scale = max((float(x.abs().max()) for x in la[:upto]), default=1.0)
    allowed = 0.0 if exact else tolerance(precision, scale)
    tie = False
    if first is not None and first < min(len(la), len(b)) and not exact:
        row = la[first]
        drift = max(diffs[:-1], default=0.0)  # seen on the rows before the divergence
        step = max(scale, 1.0) * _ROUNDING_STEP.get(precision, 2.0**-7)
        tie = float(row.max() - row[b[first]]) <= max(drift, step)
    return Comparison(first is None, first, max(diffs, default=0.0), allowed, tie)


class PromptCheck(NamedTuple):
    rows: list[VerifyRow]
    cold: GenerationResult  # the lone cold run every row was compared with


def verify_prompt(engine: Engine, prompt_ids: Sequence[int], label: str, max_new_tokens: int) -> (
    list[VerifyRow]
):
    return check_prompt(engine, prompt_ids, label, max_new_tokens).rows


def check_prompt(engine: Engine, prompt_ids: Sequence[int], label: str,
                 max_new_tokens: int) -> PromptCheck:
    """`verify_prompt`'s rows, with the cold run they were compared with."""
    if engine.cache is None:
        raise ValueError("verify needs an engine with a cache")
    ids = list(prompt_ids)
    precision = engine.runner.precision
    engine.cache.clear()
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    cold = engine.without_cache().generate(Request(ids, greedy, record_logits=True))
    half = ids[: max(1, len(ids) // 2)]
    if len(half) < len(ids):
        engine.generate(Request(half, SamplingParams(max_new_tokens=1)))
    runs = [(s, cold, engine.generate(Request(ids, greedy, record_logits=True)))
            for s in ("prefix hit", "exact repeat")]
    runs.append(("in a batch", cold, batched(engine.without_cache(), ids, greedy)))
    runs.append(("plain generate", plain_generate(engine, ids, max_new_tokens), cold))
    exact = engine.runner.invariant
    rows = []
    for scenario, reference, run in runs:
        c = compare(reference, run, precision, exact)
        rows.append(VerifyRow(
            prompt=label, scenario=scenario, prompt_tokens=len(ids),
            hit_tokens=run.cache_hit_tokens, source=run.hit_source, tokens_equal=c.equal,
            first_divergence=c.first, max_logit_diff=c.diff, generated=len(run.token_ids),
            tie=c.tie, tolerance=c.tolerance, draft_accepted=run.draft_accepted, exact=exact))
    return PromptCheck(rows, cold)


def batched(engine: Engine, ids: Sequence[int], params: SamplingParams) -> GenerationResult:
    """`ids` decoded in one batch with two other sequences (its second half first, and its
    first two thirds), submitted together so that they prefill and decode side by side."""
    from kvchat.engine.handle import RequestHandle

    others = [list(ids[len(ids) // 2 :]), list(ids[: max(1, 2 * len(ids) // 3)])]
    handles: list[RequestHandle] = [engine.submit(Request(list(ids), params, record_logits=True))]
    handles += [engine.submit(Request(o, params)) for o in others]
    while not all(h.done for h in handles):
        engine.step()
    result = handles[0].result
    if result is None:
        raise RuntimeError(f"the batched run failed: {handles[0].error}")
    return result


def plain_generate(engine: Engine, ids: Sequence[int], max_new_tokens: int,
                   model: Any = None) -> GenerationResult:
    """transformers' own greedy `generate` on the engine's model (same weights, same kernels),
    or on `model` (the float32 reference), as a result `compare` reads."""
    import torch
    from transformers import GenerationConfig

    model = engine.runner.model if model is None else model
    eos = sorted(engine.codec.eos_ids)
    # greedy and nothing else: a model's own generation config may add penalties kvchat lacks
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=eos or None, pad_token_id=eos[0] if eos else None,
                              output_logits=True, return_dict_in_generate=True)
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(torch.tensor([list(ids)], device=device),
                             generation_config=config)
    tokens = out.sequences[0, len(ids):].tolist()
    return GenerationResult(
        text="", token_ids=tokens, prompt_tokens=len(ids), cache_hit_tokens=0, hit_source="off",
        computed_tokens=len(ids), prefill_ms=0.0, ttft_ms=0.0, decode_tokens_per_s=0.0,
        total_ms=0.0, finish_reason="stop", stored_tokens=0,
        step_logits=[row[0].float().cpu() for row in out.logits])


class Fidelity(NamedTuple):
    """A prompt's kvchat text against the float32 model's own `generate` (same file, weights
    read at float32): how close the precision comes, not a cache check."""
    prompt: str
    equal: bool
    first_divergence: int | None  # index into the generated tokens
    generated: int


def fidelity(engine: Engine, reference: Any, ids: Sequence[int], cold: GenerationResult,
             label: str, max_new_tokens: int) -> Fidelity:
    """kvchat's cold greedy run of `ids` (`cold`, from `check_prompt`) against `reference`
    (a float32 model)'s `generate`, token by token."""
    want = plain_generate(engine, ids, max_new_tokens, reference)
    c = compare(want, cold)
    return Fidelity(label, c.equal, c.first, len(cold.token_ids))
