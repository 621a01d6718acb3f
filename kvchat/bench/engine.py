"""What the cache buys a request, measured on a real model within one run.

- ttft: time to first token for cold / warm full-prefix hit / exact repeat, next to one decode
  step at the same context length (the ratio that says "prefill skipped").
- overhead: a cache miss with the cache on vs off (the price of looking up and storing), and decode
  tokens/s of kvchat's loop vs plain `model.generate`.

Each figure is the median of repeated trials after a warm-up; ratios are taken within the run,
so they hold up on a noisy shared machine better than absolute times do.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvchat.bench.results import Timing, as_json
from kvchat.bench.timing import measure, timed
from kvchat.cache.stats import ratio
from kvchat.config import CacheConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.past import build_past, past_kv
from kvchat.engine.sequence import Request


def random_prompt(engine: Engine, n: int, seed: int) -> list[int]:
    """n ordinary (non-special) token ids, deterministic per seed."""
    tokenizer = engine.codec.tokenizer
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = len(tokenizer)
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        tok = rng.randrange(0, vocab)
        if tok not in special:
            out.append(tok)
    return out


@dataclass(frozen=True)
class TTFTRow:
    prompt_tokens: int
    cold: Timing
    warm: Timing  # whole prompt but its last token cached (radix)
    exact: Timing  # exact repeat: stored logits, no forward
    decode_step: Timing  # one decode step at this context length

    @property
    def warm_vs_decode(self) -> float:
        return self.warm.median_ms / self.decode_step.median_ms

    @property
    def exact_vs_decode(self) -> float:
        return self.exact.median_ms / self.decode_step.median_ms

    @property
    def cold_vs_warm(self) -> float:
        return self.cold.median_ms / self.warm.median_ms


def _decode_step(engine: Engine, ids: Sequence[int], trials: int) -> Timing:
    """One forward of one token after a context of len(ids), on a fresh copy each trial."""
    model, device = engine.runner.model, engine.device
    with torch.inference_mode():
        out = model(
            input_ids=torch.tensor([list(ids)], device=device),
            use_cache=True,
            logits_to_keep=1,
        )
        kv = past_kv(out.past_key_values, 0, len(ids))
        nxt = torch.tensor([[int(out.logits[0, -1].argmax())]], device=device)

        def step() -> float:
            past = build_past(kv, model.config)  # rebuilt outside the timed region
            return timed(lambda: model(input_ids=nxt, past_key_values=past, use_cache=True,
                                       logits_to_keep=1), device).seconds

        return measure(step, trials)


def bench_ttft(
    model: Any,
    tokenizer: Any,
    lengths: Sequence[int] = (128, 512, 1024, 2048),
    trials: int = 5,
    block_size: int = 16,
    policy: str = "lru",
    progress: Callable[[str], None] | None = None,
) -> list[TTFTRow]:
    rows = []
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    cold_backend = Engine.create(model, tokenizer, None)
    max_len = min(max(lengths), cold_backend.max_context - 2)
    budget = CacheConfig(block_size, num_blocks=4 * (max_len // block_size + 2), policy=policy)
    # two caches: the warm one keeps no exact entries, so every trial stays a radix hit
    warm_cfg = CacheConfig(block_size, num_blocks=budget.num_blocks, policy=policy,
                           max_exact_entries=0)
    for n in lengths:
        n = min(n, max_len)
        if progress:
            progress(f"ttft: {n}-token prompt")
        ids = random_prompt(cold_backend, n, seed=n)
        warm_backend = Engine.create(model, tokenizer, warm_cfg)
        exact_backend = Engine.create(model, tokenizer, budget)
        warm_backend.generate(Request(ids + random_prompt(cold_backend, 1, 0), one))
        exact_backend.generate(Request(ids, one))

        def ttft(b: Engine, ids: list[int] = ids) -> Callable[[], float]:
            return lambda: b.generate(Request(ids, one)).ttft_ms / 1e3

        cold = measure(ttft(cold_backend), max(2, trials // 2))
        warm = measure(ttft(warm_backend), trials)
        exact = measure(ttft(exact_backend), trials)
        step = _decode_step(cold_backend, ids, trials)
        rows.append(TTFTRow(n, cold, warm, exact, step))
        del warm_backend, exact_backend
    return rows


@dataclass(frozen=True)
class OverheadResult:
    prompt_tokens: int
    new_tokens: int
    miss_cache_on: Timing  # whole request, a prompt never seen before, cache on
    miss_cache_off: Timing
    kvchat_decode_tps: float  # median over trials
    generate_decode_tps: float
    miss_ratios: tuple[float, ...]  # on / off, trial by trial (paired, order alternating)
    decode_ratios: tuple[float, ...]  # kvchat / generate decode tokens/s, trial by trial
    h2o_prefill_ratios: tuple[float, ...] = ()  # miss TTFT with h2o's attention / with lru's

    @property
    def h2o_prefill_ratio(self) -> float | None:
        return statistics.median(self.h2o_prefill_ratios) if self.h2o_prefill_ratios else None

    @property
    def miss_overhead(self) -> float:
        return statistics.median(self.miss_ratios) - 1

    @property
    def decode_ratio(self) -> float:
        return statistics.median(self.decode_ratios)


class _TokenClock:
    """A generate() streamer that stamps each token: the first put() carries the prompt."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: Any) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass

    def decode_tps(self) -> float:
        tokens = self.stamps[1:]  # the first put is the prompt
        return (len(tokens) - 1) / (tokens[-1] - tokens[0]) if len(tokens) > 1 else 0.0


def bench_overhead(
    model: Any,
    tokenizer: Any,
    prompt_tokens: int = 512,
    new_tokens: int = 32,
    trials: int = 5,
    block_size: int = 16,
    policy: str = "lru",
    progress: Callable[[str], None] | None = None,
) -> OverheadResult:
    """Trials are paired and their order alternates, so drift on a shared machine hits both
    sides alike; the ratios reported are medians of the per-trial ratios."""
    off = Engine.create(model, tokenizer, None)
    per_request = prompt_tokens + new_tokens + block_size
    cfg = CacheConfig(block_size, num_blocks=(trials + 3) * 2 * per_request // block_size,
                      policy=policy)
    on = Engine.create(model, tokenizer, cfg)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    seeds = iter(range(10_000, 20_000))

    def request(b: Engine) -> tuple[float, float]:
        res = b.generate(Request(random_prompt(off, prompt_tokens, next(seeds)), params))
        return res.total_ms, res.decode_tokens_per_s

    def generate() -> float:
        ids = torch.tensor([random_prompt(off, prompt_tokens, next(seeds))], device=off.device)
        clock = _TokenClock()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=tokenizer.eos_token_id, streamer=clock)
        return clock.decode_tps()

    if progress:
        progress("overhead: cache miss, cache on vs off")
    request(on), request(off)  # warm-up
    miss = _paired(lambda: request(on)[0], lambda: request(off)[0], trials)
    on_ms, off_ms = [a for a, _ in miss], [b for _, b in miss]
    if progress:
        progress("overhead: decode tokens/s vs model.generate")
    generate()  # warm-up
    decode = _paired(lambda: request(on)[1], generate, trials)
    kv_tps, gen_tps = [a for a, _ in decode], [b for _, b in decode]
    if progress:
        progress("overhead: prefill with h2o's attention vs the default")
    h2o_cfg = CacheConfig(block_size, num_blocks=cfg.num_blocks, policy="h2o")
    one = SamplingParams(max_new_tokens=1)
    # the h2o engine asks for attention weights per forward; the lru one on the same model keeps
    # the fused kernel (kvchat never switches a model's attention for everyone)
    h2o = Engine.create(model, tokenizer, h2o_cfg)

    def miss_ttft(b: Engine) -> float:
        return b.generate(Request(random_prompt(off, prompt_tokens, next(seeds)), one)).ttft_ms

    miss_ttft(h2o), miss_ttft(on)  # warm-up
    pairs = _paired(lambda: miss_ttft(h2o), lambda: miss_ttft(on), trials)
    h2o_ratios = [a / b for a, b in pairs]
    return OverheadResult(
        prompt_tokens,
        new_tokens,
        Timing.of([ms / 1e3 for ms in on_ms]),
        Timing.of([ms / 1e3 for ms in off_ms]),
        statistics.median(kv_tps),
        statistics.median(gen_tps),
        tuple(a / b for a, b in zip(on_ms, off_ms, strict=True)),
        tuple(a / b for a, b in zip(kv_tps, gen_tps, strict=True)),
        tuple(h2o_ratios),
    )


def _paired(
    first: Callable[[], float], second: Callable[[], float], trials: int
) -> list[tuple[float, float]]:
    """(first(), second()) per trial, the call order alternating so that drift on a shared
    machine hits both sides alike."""
    out = []
    for i in range(trials):
        if i % 2:
            b = second()
            a = first()
        else:
            a = first()
            b = second()
        out.append((a, b))
    return out


def as_dict(obj: Any) -> Any:
    """JSON-ready form of a result (dataclasses, with derived ratios; times in ms)."""
    if isinstance(obj, list):
        return [as_dict(o) for o in obj]
    out = as_json(obj, "ms")
    for name in ("warm_vs_decode", "exact_vs_decode", "cold_vs_warm", "miss_overhead",
                 "decode_ratio", "h2o_prefill_ratio"):
        if hasattr(obj, name):
            out[name] = getattr(obj, name)
    return out


_QUESTIONS = [
    "Hi! Can you help me plan a weekend hike?",
    "What should I pack for it?",
    "How much water is enough?",
    "And if it rains?",
    "Any tips for blisters?",
    "What snacks travel well?",
    "How early should I start?",
    "Thanks, anything else?",
]


@dataclass(frozen=True)
class TurnRow:
    turn: int
    prompt_tokens: int
    hit_tokens: int
    ttft_on: float  # ms, cache on
    ttft_off: float  # ms, cache off (the whole history prefilled every turn)

    @property
    def hit_rate(self) -> float:
        return ratio(self.hit_tokens, self.prompt_tokens)


def bench_multiturn(
    model: Any,
    tokenizer: Any,
    turns: int = 6,
    max_new_tokens: int = 32,
    block_size: int = 16,
    system: str | None = "You are a friendly outdoor guide. Answer in two sentences.",
    progress: Callable[[str], None] | None = None,
) -> list[TurnRow]:
    """A scripted chat, run twice on the same prompts: through the cache (each turn extends the
    session's token history) and with the cache off."""
    from kvchat.sessions import Session
    from kvchat.turns import next_prompt, record_turn

    on = Engine.create(model, tokenizer, CacheConfig(block_size, cache_mb=256))
    off = Engine.create(model, tokenizer, None)
    session = Session("bench", system=system)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    rows = []
    for k in range(turns):
        if progress:
            progress(f"multiturn: turn {k + 1}/{turns}")
        text = _QUESTIONS[k % len(_QUESTIONS)]
        prompt = next_prompt(on.codec, session, text)
        cold = off.generate(Request(prompt, SamplingParams(max_new_tokens=1)))
        warm = on.generate(Request(prompt, params, sid="bench"))
        record_turn(session, text, prompt, warm)
        rows.append(TurnRow(k + 1, warm.prompt_tokens, warm.cache_hit_tokens, warm.ttft_ms,
                            cold.ttft_ms))
    return rows
