"""`kvchat bench fleet` on the tiny model: real instances behind a real sglang-router (two setups
of the five, and short workloads, to stay quick), and its table."""

from __future__ import annotations

from pathlib import Path

import pytest
from _fleet_helpers import router_binary
from rich.console import Console

from kvchat.bench import fleet as fleet_bench
from kvchat.bench.fleet import FleetConfig, Setup, bench_fleet
from kvchat.bench.fleet_results import FleetBench, FleetRun
from kvchat.ui.fleet_view import fleet_table

SYSTEM = "<|im_start|>system\\n" + "Answer every question about tents briefly. " * 12


def test_bench_fleet_measures_a_fleet_against_one_instance(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    router_binary("sglang")
    monkeypatch.setattr(fleet_bench, "setups", lambda n: (
        Setup("1 instance", 1, None, False), Setup("2 cache_aware + shared", 2, "cache_aware",
                                                   True)))
    prompts = [f"{SYSTEM}<|im_end|>\\n<|im_start|>user\\nQuestion {i}?<|im_end|>\\n"
               for i in range(8)]
    result = bench_fleet(FleetConfig(str(tiny_model_dir), 2, 2, 2, 16.0),
                         {"shared-system": prompts})
    single, pair = result.runs
    assert (single.instances, pair.instances) == (1, 2)
    for run in result.runs:
        assert run.requests == 8 and run.failures == 0 and run.completion_tokens == 16
        assert 0 < run.hit_tokens < run.prompt_tokens
    assert single.hit_rate > 0.5 and single.shared_hit_tokens == 0
    assert pair.shared_hit_tokens <= pair.hit_tokens
    assert result.of_single(pair) == pytest.approx(pair.hit_rate / single.hit_rate)


def test_the_fleet_table_shows_each_setup_against_one_instance() -> None:
    runs = (FleetRun("1 instance", 1, None, False, "shared-system", 4, 1000, 900, 0, 64, 2.0),
            FleetRun("2 round_robin + shared", 2, "round_robin", True, "shared-system", 4, 1000,
                     810, 120, 64, 1.0, failures=1))
    bench = FleetBench(2, "sglang-router", 4, 16, {1: 2, 2: 1}, runs)
    console = Console(width=120, record=True)
    console.print(fleet_table(bench))
    text = console.export_text()
    assert "shared-system (4 requests)" in text
    assert "90.0%" in text and "81.0%" in text and "90.0%" in text.split("81.0%")[1]  # of 1
    assert "120" in text and "3.00" in text  # shared tokens; 3 of 4 requests in 1 s
    assert bench.as_dict()["runs"][1]["of_single"] == pytest.approx(0.9)
