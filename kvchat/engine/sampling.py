"""Turning a row of logits into the next token: greedy, or temperature / top-k / top-p sampling.

Every SamplingParams the config accepts samples, whatever the row holds: the most likely token
always keeps a share of the mass, so the distribution `multinomial` gets is never empty."""

from __future__ import annotations

import torch

from kvchat.config import SamplingParams

NEG_INF = float("-inf")


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    return gen


def scaled_scores(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 (vocab,) scores in [-inf, 0] whose largest is exactly 0, at the first most
    likely token: logits / temperature with no NaN and no +inf, for any temperature and any
    row (float16 overflow to +inf, -inf masks, NaN, all -inf)."""
    x = torch.nan_to_num(logits.float(), nan=NEG_INF, posinf=torch.finfo(torch.float32).max,
                         neginf=NEG_INF)
    top = torch.argmax(x).view(1)
    # shifting first keeps a tiny temperature from overflowing to +inf (softmax would give NaN)
    scores = torch.nan_to_num((x - x.max()) / temperature, nan=NEG_INF, neginf=NEG_INF)
    return scores.index_fill_(0, top, 0.0)  # an all -inf row (-inf - -inf is NaN) keeps its top


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Next token id from a (vocab,) row of logits."""
    if params.greedy:
        # the first largest value, as argmax gives; over float32 (exact) it is 5x faster on CPU
        return int(torch.argmax(logits.float()).item())
    scores = scaled_scores(logits, params.temperature)
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, NEG_INF)
    probs = torch.softmax(scores, dim=-1)  # its largest is exp(0) / sum >= 1 / vocab: never 0
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest set whose mass reaches top_p; the top token whatever top_p is (a
        # top_p below float32's smallest, e.g. 1e-300, compares as 0 and would cut it too)
        cut = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        cut[0] = False
        sorted_probs = sorted_probs.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen).item())
