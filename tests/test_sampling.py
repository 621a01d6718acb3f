"""The sampler: every SamplingParams the config accepts samples, whatever the row of logits
holds (float16 overflow to +inf, -inf masks, NaN, huge values, every dtype), and the nucleus
always keeps the most likely token."""

from __future__ import annotations

import math

import pytest
import torch

from kvchat.config import MIN_TEMPERATURE, SamplingParams
from kvchat.engine.sampling import make_generator, sample, scaled_scores

INF = math.inf
VOCAB = 64
ROW = torch.linspace(-3.0, 5.0, VOCAB).roll(17)  # one most likely token, at index 16
TOP = int(torch.argmax(ROW))

ROWS = {
    "plain": ROW,
    "masked": ROW.masked_fill(torch.arange(VOCAB) % 3 == 0, -INF),
    "huge": ROW * 1e37,  # / MIN_TEMPERATURE overflows float32
    "max": torch.full((VOCAB,), torch.finfo(torch.float32).max),
    "+inf": ROW.masked_fill(torch.arange(VOCAB) == 5, INF),
    "nan": ROW.masked_fill(torch.arange(VOCAB) == 7, math.nan),
    "all -inf": torch.full((VOCAB,), -INF),
    "all nan": torch.full((VOCAB,), math.nan),
}
TEMPERATURES = [MIN_TEMPERATURE, 1.0, 1e30, 1e300, 1.7e308]
TOP_PS = [5e-324, 1e-300, 1e-40, 0.5, 1.0]
TOP_KS = [0, 1, 5, VOCAB + 10]


def draw(logits: torch.Tensor, seed: int = 0, **kw: float) -> int:
    params = SamplingParams(seed=seed, **kw)  # type: ignore[arg-type]
    return sample(logits, params, make_generator(params, logits.device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-40, 1e-8])
def test_a_tiny_top_p_keeps_exactly_the_most_likely_token(top_p: float, dtype: torch.dtype):
    for seed in range(20):
        assert draw(ROW.to(dtype), seed, temperature=1.0, top_p=top_p) == TOP


@pytest.mark.parametrize("name", list(ROWS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_accepted_combination_samples_a_token_the_row_allows(name: str,
                                                                   dtype: torch.dtype):
    logits = ROWS[name].to(dtype)  # float16 turns "huge" and "max" into +inf
    x = logits.float()
    allowed = set(range(VOCAB)) if x.isnan().all() or (x == -INF).all() else \
        {i for i in range(VOCAB) if not math.isnan(x[i]) and x[i] > -INF}
    for temperature in TEMPERATURES:
        for top_p in TOP_PS:
            for top_k in TOP_KS:
                tok = draw(logits, 3, temperature=temperature, top_p=top_p, top_k=top_k)
                assert tok in allowed, (temperature, top_p, top_k, tok)
                if "+inf" in name and temperature <= 1e30:  # +inf outweighs every finite logit
                    assert tok == 5
                if top_k == 1 or top_p < 1e-30:
                    # one of the most likely tokens (a huge temperature ties many of them)
                    probs = torch.softmax(scaled_scores(logits, temperature), dim=-1)
                    assert probs[tok] == probs.max(), (temperature, top_p, top_k, tok)


def test_the_nucleus_is_the_smallest_set_reaching_top_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    seen = {p: {draw(logits, seed, temperature=1.0, top_p=p) for seed in range(200)}
            for p in (0.4, 0.6, 0.9, 1.0)}
    assert seen == {0.4: {0}, 0.6: {0, 1}, 0.9: {0, 1, 2}, 1.0: {0, 1, 2, 3}}


def test_scaled_scores_are_the_tempered_softmax_of_an_ordinary_row():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for temperature in (0.3, 1.0, 7.0):
            logits = ROW.to(dtype)
            want = torch.softmax(logits.float() / temperature, dim=-1)
            got = torch.softmax(scaled_scores(logits, temperature), dim=-1)
            torch.testing.assert_close(got, want)


def test_scaled_scores_peak_at_zero_on_the_first_most_likely_token():
    for name, logits in ROWS.items():
        for temperature in TEMPERATURES:
            scores = scaled_scores(logits, temperature)
            assert scores.dtype == torch.float32 and not scores.isnan().any(), name
            assert float(scores.max()) == 0.0 and (scores <= 0).all(), name
    assert int(torch.argmax(scaled_scores(ROWS["all -inf"], 1.0))) == 0
    assert int(torch.argmax(scaled_scores(ROWS["+inf"], 1.0))) == 5
