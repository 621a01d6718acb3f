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
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvchat.config import CacheConfig, SamplingParams
from kvchat.engine.backend import Backend, Request, build_past, past_kv


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float

    def __str__(self) -> str:
        return f"{self.median_ms:.1f} ({self.min_ms:.1f}-{self.max_ms:.1f})"


def measure(fn: Callable[[], float | None], trials: int, warmup: int = 1) -> Timing:
    """Median/min/max over trials of fn's own figure (ms) or, if it returns None, its wall time."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(trials):
        t = time.perf_counter()
        got = fn()
        samples.append(got if got is not None else (time.perf_counter() - t) * 1000)
    return Timing(statistics.median(samples), min(samples), max(samples))


def random_prompt(backend: Backend, n: int, seed: int) -> list[int]:
    """n ordinary (non-special) token ids, deterministic per seed."""
    special = set(getattr(backend.tokenizer, "all_special_ids", []) or [])
    vocab = len(backend.tokenizer)
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


def _decode_step(backend: Backend, ids: Sequence[int], trials: int) -> Timing:
    """One forward of one token after a context of len(ids), on a fresh copy each trial."""
    with torch.inference_mode():
        out = backend.model(
            input_ids=torch.tensor([list(ids)], device=backend.device),
            use_cache=True,
            logits_to_keep=1,
        )
        kv = past_kv(out.past_key_values, 0, len(ids))
        nxt = torch.tensor([[int(out.logits[0, -1].argmax())]], device=backend.device)

        def step() -> float:
            past = build_past(kv, backend.model.config)  # rebuilt outside the timed region
            t = time.perf_counter()
            backend.model(input_ids=nxt, past_key_values=past, use_cache=True, logits_to_keep=1)
            return (time.perf_counter() - t) * 1000

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
    cold_backend = Backend(model, tokenizer, None)
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
        warm_backend = Backend.create(model, tokenizer, warm_cfg)
        exact_backend = Backend.create(model, tokenizer, budget)
        warm_backend.generate(Request(ids + random_prompt(cold_backend, 1, 0), one))
        exact_backend.generate(Request(ids, one))

        def ttft(b: Backend, ids: list[int] = ids) -> Callable[[], float]:
            return lambda: b.generate(Request(ids, one)).ttft_ms

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

    @property
    def miss_overhead(self) -> float:
        return self.miss_cache_on.median_ms / self.miss_cache_off.median_ms - 1

    @property
    def decode_ratio(self) -> float:
        return self.kvchat_decode_tps / self.generate_decode_tps


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
    off = Backend(model, tokenizer, None)
    per_request = prompt_tokens + new_tokens + block_size
    cfg = CacheConfig(block_size, num_blocks=(trials + 3) * 2 * per_request // block_size,
                      policy=policy)
    on = Backend.create(model, tokenizer, cfg)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    seeds = iter(range(10_000, 20_000))
    if progress:
        progress("overhead: cache miss, cache on vs off")
    tps: list[float] = []

    def request(b: Backend) -> Callable[[], float]:
        def go() -> float:
            res = b.generate(Request(random_prompt(off, prompt_tokens, next(seeds)), params))
            if b is on:
                tps.append(res.decode_tokens_per_s)
            return res.total_ms

        return go

    # interleave on/off trials so drift on a shared machine hits both alike
    on_ms, off_ms = [], []
    request(on)()
    request(off)()
    tps.clear()
    for _ in range(trials):
        on_ms.append(request(on)())
        off_ms.append(request(off)())
    if progress:
        progress("overhead: decode tokens/s vs model.generate")
    gen_tps = _generate_decode_tps(off, prompt_tokens, new_tokens, trials)
    return OverheadResult(
        prompt_tokens,
        new_tokens,
        Timing(statistics.median(on_ms), min(on_ms), max(on_ms)),
        Timing(statistics.median(off_ms), min(off_ms), max(off_ms)),
        statistics.median(tps),
        gen_tps,
    )


def _generate_decode_tps(b: Backend, prompt_tokens: int, new_tokens: int, trials: int) -> float:
    """Decode tokens/s of plain model.generate: (N-1) tokens over the time between a 1-token and
    an N-token generate of the same prompt (the prefill cancels out)."""
    ids = torch.tensor([random_prompt(b, prompt_tokens, 7)], device=b.device)
    mask = torch.ones_like(ids)

    def gen(n: int) -> Callable[[], None]:
        def go() -> None:
            with torch.inference_mode():
                b.model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=b.tokenizer.eos_token_id,
                )

        return go

    rates = []
    for _ in range(max(2, trials // 2)):
        t1 = measure(gen(1), 1, warmup=0).median_ms
        tn = measure(gen(new_tokens), 1, warmup=0).median_ms
        rates.append((new_tokens - 1) / max(tn - t1, 1e-6) * 1000)
    return statistics.median(rates)


def as_dict(obj: Any) -> Any:
    """JSON-ready form of a result (dataclasses, with derived ratios)."""
    if isinstance(obj, list):
        return [as_dict(o) for o in obj]
    out = asdict(obj)
    for name in ("warm_vs_decode", "exact_vs_decode", "cold_vs_warm", "miss_overhead",
                 "decode_ratio"):
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
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


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
    from kvchat.engine.conversation import next_prompt, record_turn
    from kvchat.sessions import Session

    on = Backend.create(model, tokenizer, CacheConfig(block_size, cache_mb=256))
    off = Backend(model, tokenizer, None)
    session = Session("bench", system=system)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    rows = []
    for k in range(turns):
        if progress:
            progress(f"multiturn: turn {k + 1}/{turns}")
        text = _QUESTIONS[k % len(_QUESTIONS)]
        prompt = next_prompt(on, session, text)
        cold = off.generate(Request(prompt, SamplingParams(max_new_tokens=1)))
        warm = on.generate(Request(prompt, params, sid="bench"))
        record_turn(session, text, prompt, warm)
        rows.append(TurnRow(k + 1, warm.prompt_tokens, warm.cache_hit_tokens, warm.ttft_ms,
                            cold.ttft_ms))
    return rows
