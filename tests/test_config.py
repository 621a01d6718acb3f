"""Sampling values are checked where they are parsed: every bad value a CLI option, a batch file or
an HTTP body can carry becomes one ConfigError naming the field, before any model work."""

from __future__ import annotations

import math

import pytest

from kvchat.config import MIN_TEMPERATURE, ConfigError, SamplingParams
from kvchat.errors import KvchatError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": math.nan}, "temperature must be a finite number, got nan."),
        ({"temperature": math.inf}, "temperature must be a finite number, got inf."),
        ({"temperature": -math.inf}, "temperature must be a finite number, got -inf."),
        ({"temperature": 1e-40},
         "temperature must be 0 (greedy) or at least 1e-05, got 1e-40."),
        ({"temperature": 9.99e-6},
         "temperature must be 0 (greedy) or at least 1e-05, got 9.99e-06."),
        ({"temperature": -0.5}, "temperature must be 0 (greedy) or at least 1e-05, got -0.5."),
        ({"temperature": "0.7"}, "temperature must be a finite number, got '0.7'."),
        ({"top_p": math.nan}, "top_p / --top-p must be a finite number, got nan."),
        ({"top_p": math.inf}, "top_p / --top-p must be a finite number, got inf."),
        ({"top_p": 0.0}, "top_p / --top-p must be in (0, 1], got 0.0."),
        ({"top_p": -0.1}, "top_p / --top-p must be in (0, 1], got -0.1."),
        ({"top_p": 1.0000001}, "top_p / --top-p must be in (0, 1], got 1.0000001."),
        ({"top_k": -1}, "top_k / --top-k must be 0 (off) or more, got -1."),
        ({"top_k": 2.5}, "top_k / --top-k must be a whole number, got 2.5."),
        ({"top_k": math.inf}, "top_k / --top-k must be a whole number, got inf."),
        ({"seed": -1}, "seed must be from 0 to 2**64 - 1, got -1."),
        ({"seed": 2**64}, f"seed must be from 0 to 2**64 - 1, got {2**64}."),
        ({"seed": 2**70}, f"seed must be from 0 to 2**64 - 1, got {2**70}."),
        ({"seed": 1.5}, "seed must be a whole number, got 1.5."),
        ({"seed": True}, "seed must be a whole number, got True."),
        ({"max_new_tokens": 0}, "max_tokens / --max-tokens must be at least 1, got 0."),
        ({"max_new_tokens": -5}, "max_tokens / --max-tokens must be at least 1, got -5."),
        ({"max_new_tokens": math.nan},
         "max_tokens / --max-tokens must be a whole number, got nan."),
        ({"max_new_tokens": 10.0}, "max_tokens / --max-tokens must be a whole number, got 10.0."),
    ],
)
def test_bad_sampling_values_are_refused_with_a_clear_message(kwargs, message):
    with pytest.raises(ConfigError) as exc:
        SamplingParams(**kwargs)
    assert str(exc.value) == message
    assert isinstance(exc.value, KvchatError)  # printed by the CLI and the server without a trace


def test_the_cli_option_is_named_where_it_differs_from_the_field():
    with pytest.raises(ConfigError, match=r"--top-p must be in \(0, 1\]"):
        SamplingParams(temperature=0.5, top_p=0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0},
        {"temperature": 0.0, "top_p": 1, "top_k": 0},
        {"temperature": MIN_TEMPERATURE},
        {"temperature": 1e-5, "top_p": 1e-9},
        {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "seed": 0},
        {"temperature": 2, "seed": 2**64 - 1},
        {"temperature": 1e6},
        {"max_new_tokens": 1, "seed": 12345},
        {"max_new_tokens": 100_000},
    ],
)
def test_good_sampling_values_are_kept(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value
    assert params.greedy == (params.temperature == 0)


def test_the_extreme_seeds_are_accepted_by_torch():
    """The bounds are torch's: manual_seed takes both ends of the range SamplingParams allows."""
    import torch

    for seed in (SamplingParams(seed=0).seed, SamplingParams(seed=2**64 - 1).seed):
        assert seed is not None
        torch.Generator().manual_seed(seed)
    for refused in (2**64, 2**70):  # what SamplingParams keeps from reaching the sampler
        with pytest.raises((RuntimeError, ValueError)):
            torch.Generator().manual_seed(refused)
