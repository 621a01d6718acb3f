"""kvchat's batch path against what users would otherwise run, on one workload, in one run.

Workload: N requests sharing a long system prompt, each with a short distinct question, greedy,
the same max_new_tokens everywhere. Contenders:
- plain `model.generate`, one request at a time (no reuse);
- transformers `generate_batch` (continuous batching, paged, prefix block sharing on);
- kvchat: the shared cache + cache-aware scheduler + batched decode.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvchat.config import CacheConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.sequence import Request

_TOPICS = [
    "billing", "shipping", "returns", "warranty", "accounts", "security", "privacy", "pricing",
    "discounts", "gift cards", "subscriptions", "refunds", "exchanges", "repairs", "delivery",
    "tracking", "invoices", "taxes", "loyalty points", "student offers", "bulk orders",
    "international orders", "damaged items", "missing parts", "installation", "compatibility",
    "trade-ins", "rentals", "memberships", "cancellations", "pre-orders", "price matching",
]


def shared_prompt_workload(
    tokenizer: Any, n_requests: int = 32, system_tokens: int = 600
) -> list[list[int]]:
    """n chat prompts: one ~system_tokens-token system prompt, distinct short questions.
    Deterministic, so every contender sees exactly the same token ids."""
    rules = []
    i = 0
    while True:
        topic = _TOPICS[i % len(_TOPICS)]
        rules.append(f"Rule {i + 1}: questions about {topic} are answered politely, briefly, "
                     f"and only with facts from the {topic} handbook, section {i % 7 + 1}.")
        system = "You are the support assistant of Acme Outdoor Gear. " + " ".join(rules)
        ids = tokenizer.apply_chat_template([{"role": "system", "content": system}],
                                            tokenize=False)
        if len(tokenizer(ids, add_special_tokens=False)["input_ids"]) >= system_tokens:
            break
        i += 1
    prompts = []
    for k in range(n_requests):
        topic = _TOPICS[k % len(_TOPICS)]
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Question {k + 1}: how do {topic} work for order {k}?"},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


def ideal_prefill(prompts: list[list[int]]) -> int:
    """Prompt tokens a perfect prefix cache computes: each distinct prefix once."""
    seen: set[tuple[int, ...]] = set()
    for p in prompts:
        for i in range(1, len(p) + 1):
            seen.add(tuple(p[:i]))
    return len(seen)


@dataclass
class Contender:
    name: str
    seconds: float | None
    outputs: list[list[int]] = field(default_factory=list)
    prefill_tokens: int | None = None
    note: str = ""


@dataclass
class BatchBench:
    requests: int
    prompt_tokens: int
    new_tokens: int
    ideal_prefill: int
    contenders: list[Contender]

    def speedup(self, baseline: str, name: str = "kvchat") -> float | None:
        by = {c.name: c.seconds for c in self.contenders}
        a, b = by.get(baseline), by.get(name)
        return a / b if a and b else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "ideal_prefill_tokens": self.ideal_prefill,
            "contenders": [
                {"name": c.name, "seconds": c.seconds, "prefill_tokens": c.prefill_tokens,
                 "note": c.note}
                for c in self.contenders
            ],
        }


def run_plain_generate(model: Any, tokenizer: Any, prompts: list[list[int]], new: int) -> (
    Contender
):
    outputs = []
    t = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=new, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
            outputs.append(out[0, len(p):].tolist())
    return Contender("model.generate", time.perf_counter() - t, outputs,
                     sum(len(p) for p in prompts), "one request at a time")


def run_generate_batch(
    model: Any, prompts: list[list[int]], new: int, page_size: int = 16,
    max_batch_tokens: int = 256,
) -> Contender:
    name = "generate_batch"
    try:
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        gen_cfg = GenerationConfig(max_new_tokens=new, do_sample=False,
                                   eos_token_id=model.generation_config.eos_token_id,
                                   pad_token_id=model.generation_config.eos_token_id)
        cb_cfg = ContinuousBatchingConfig(page_size=page_size, max_batch_tokens=max_batch_tokens,
                                          allow_block_sharing=True)
        # generate_batch refuses inference-mode tensors: run it outside, as its docs do
        t = time.perf_counter()
        with torch.no_grad():
            res = model.generate_batch(inputs=prompts, generation_config=gen_cfg,
                                       continuous_batching_config=cb_cfg, progress_bar=False)
        seconds = time.perf_counter() - t
    except Exception as exc:  # report, don't crash the other contenders
        return Contender(name, None, note=f"could not run: {type(exc).__name__}: {exc}")
    outs = sorted(res.values(), key=lambda o: _request_index(o.request_id))
    return Contender(name, seconds, [list(o.generated_tokens) for o in outs], None,
                     f"page_size={page_size}, max_batch_tokens={max_batch_tokens}, "
                     "allow_block_sharing=True")


def _request_index(request_id: str) -> int:
    digits = "".join(ch for ch in request_id if ch.isdigit())
    return int(digits) if digits else 0


def run_kvchat(
    model: Any, tokenizer: Any, prompts: list[list[int]], new: int, batch_size: int,
    block_size: int = 16,
) -> Contender:
    per = max(len(p) for p in prompts) + new + block_size
    cfg = CacheConfig(block_size, num_blocks=(len(prompts) + 2) * per // block_size)
    engine = Engine.create(model, tokenizer, cfg, batch_size=batch_size)
    params = SamplingParams(max_new_tokens=new)
    t = time.perf_counter()
    tickets = [engine.submit(Request(p, params)) for p in prompts]
    while not engine.idle:
        engine.step()
    seconds = time.perf_counter() - t
    outputs = [t.result.token_ids if t.result else [] for t in tickets]
    computed = sum(t.result.computed_tokens for t in tickets if t.result)
    return Contender("kvchat", seconds, outputs, computed,
                     f"batch_size={batch_size}, block_size={block_size}, {engine.steps} steps")


def bench_batch(
    model: Any,
    tokenizer: Any,
    n_requests: int = 32,
    system_tokens: int = 600,
    new_tokens: int = 16,
    batch_size: int = 32,
    include: tuple[str, ...] = ("generate", "generate_batch", "kvchat"),
    progress: Callable[[str], None] | None = None,
) -> BatchBench:
    prompts = shared_prompt_workload(tokenizer, n_requests, system_tokens)
    contenders = []
    if "kvchat" in include:
        if progress:
            progress("kvchat batch")
        contenders.append(run_kvchat(model, tokenizer, prompts, new_tokens, batch_size))
    if "generate_batch" in include:
        if progress:
            progress("transformers generate_batch")
        contenders.append(run_generate_batch(model, prompts, new_tokens))
    if "generate" in include:
        if progress:
            progress("plain model.generate, one by one")
        contenders.append(run_plain_generate(model, tokenizer, prompts, new_tokens))
    return BatchBench(len(prompts), sum(len(p) for p in prompts), new_tokens,
                      ideal_prefill(prompts), contenders)
