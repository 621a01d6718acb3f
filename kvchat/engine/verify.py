"""Cached vs uncached equivalence on a real model: what `kvchat verify` reports.

For each prompt, on its own (the cache is emptied first, so an earlier prompt's blocks never
make the hit larger than it says): a cold run with the cache off, then warm runs through the
cache - after caching the first half of the prompt (a radix hit) and again (an exact repeat) -
compared token by token and logit by logit. Greedy decoding, so any difference is a cache bug
or a float tie.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvchat.config import SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.sequence import GenerationResult, Request


@dataclass(frozen=True)
class VerifyRow:
    prompt: str
    scenario: str  # "prefix hit" | "exact repeat"
    prompt_tokens: int
    hit_tokens: int
    source: str
    tokens_equal: bool
    first_divergence: int | None  # index into the generated tokens
    max_logit_diff: float
    generated: int

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def compare(cold: GenerationResult, warm: GenerationResult) -> tuple[bool, int | None, float]:
    """(tokens equal, first divergent index, max |logit diff| up to and including it)."""
    a, b = cold.token_ids, warm.token_ids
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    la, lb = cold.step_logits or [], warm.step_logits or []
    upto = len(la) if first is None else first + 1
    diffs = [float((x - y).abs().max()) for x, y in zip(la[:upto], lb[:upto], strict=False)]
    return first is None, first, max(diffs, default=0.0)


def verify_prompt(engine: Engine, prompt_ids: Sequence[int], label: str, max_new_tokens: int) -> (
    list[VerifyRow]
):
    if engine.cache is None:
        raise ValueError("verify needs an engine with a cache")
    ids = list(prompt_ids)
    engine.cache.clear()
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    cold = engine.without_cache().generate(Request(ids, greedy, record_logits=True))
    half = ids[: max(1, len(ids) // 2)]
    if len(half) < len(ids):
        engine.generate(Request(half, SamplingParams(max_new_tokens=1)))
    rows = []
    for scenario in ("prefix hit", "exact repeat"):
        warm = engine.generate(Request(ids, greedy, record_logits=True))
        equal, first, diff = compare(cold, warm)
        rows.append(
            VerifyRow(
                prompt=label,
                scenario=scenario,
                prompt_tokens=len(ids),
                hit_tokens=warm.cache_hit_tokens,
                source=warm.hit_source,
                tokens_equal=equal,
                first_divergence=first,
                max_logit_diff=diff,
                generated=len(warm.token_ids),
            )
        )
    return rows

