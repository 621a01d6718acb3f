"""`kvchat bench cache` at toy sizes: the structure of its result, JSON and rendering (no times)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rich.console import Console

from kvchat.bench.cache import bench_bandwidth, bench_tree, run_cache_bench
from kvchat.bench.results import (
    BandwidthResult,
    CacheBenchResult,
    PolicyRow,
    Timing,
    as_json,
    format_seconds,
)
from kvchat.bench.timing import measure, timed
from kvchat.ui.bench_view import render_cache_bench


class TinyModel(torch.nn.Module):
    """Just enough of a causal LM for the prefill timing: a config and a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_size=16,
            vocab_size=50,
        )
        self.emb = torch.nn.Embedding(50, 16)
        self.calls: list[tuple[tuple[int, ...], bool]] = []

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        self.calls.append((tuple(input_ids.shape), use_cache))
        return self.emb(input_ids)


def _render(result: CacheBenchResult) -> str:
    console = Console(record=True, width=240, color_system=None)
    console.print(render_cache_bench(result))
    return console.export_text()


@pytest.fixture(scope="module")
def result() -> CacheBenchResult:
    return run_cache_bench(
        model=TinyModel(),
        sizes=(24, 60),
        prompt_tokens=64,
        lengths=(16, 64),
        bandwidth_tokens=32,
        block_size=4,
        trials=2,
    )


def test_tree_rows_keep_the_cache_at_each_size(result: CacheBenchResult) -> None:
    # a branch diverging mid-block costs one block more than its new tokens
    for row, size in zip(result.tree, (24, 60), strict=True):
        assert size <= row.cached_blocks <= size + 1
    for row in result.tree:
        assert [lk.prompt_tokens for lk in row.lookups] == [16, 64]
        assert row.tree_nodes >= row.tree_leaves >= 1
        assert 1 <= row.path_nodes <= 64 // 4 + 1
        assert row.max_siblings >= 1
        for t in (*[lk.timing for lk in row.lookups], row.store, row.evict_per_block):
            assert 0 < t.min_s <= t.median_s <= t.max_s


def test_bandwidth_with_a_model_takes_its_shape_and_times_its_prefill(
    result: CacheBenchResult,
) -> None:
    bw = result.bandwidth
    assert (bw.tokens, bw.n_layers, bw.n_kv_heads, bw.head_dim) == (32, 2, 2, 4)
    assert bw.kv_bytes == 2 * 2 * 2 * 32 * 4 * 4
    assert bw.prefill is not None and bw.gather_vs_prefill is not None
    assert bw.gather_vs_prefill == pytest.approx(bw.gather.median_s / bw.prefill.median_s)
    assert bw.gather_gb_s == pytest.approx(bw.kv_bytes / bw.gather.median_s / 1e9)


def test_prefill_runs_the_model_once_per_trial_with_the_cache_on() -> None:
    model = TinyModel()
    bw = bench_bandwidth(tokens=8, block_size=4, trials=1, model=model, prefill_trials=2)
    assert model.calls == [((1, 8), True)] * 3  # one warm-up, two trials
    assert bw.dtype == "float32" and bw.device == "cpu"


def test_bandwidth_without_a_model_uses_the_given_shape() -> None:
    bw = bench_bandwidth(tokens=10, shape=(3, 1, 2), dtype=torch.bfloat16, block_size=4, trials=1)
    assert (bw.n_layers, bw.n_kv_heads, bw.head_dim, bw.dtype) == (3, 1, 2, "bfloat16")
    assert bw.kv_bytes == 2 * 3 * 1 * 10 * 2 * 2
    assert bw.prefill is None and bw.gather_vs_prefill is None


def test_as_dict_is_json_with_the_derived_figures(result: CacheBenchResult) -> None:
    d: dict[str, Any] = json.loads(json.dumps(result.as_dict()))
    assert set(d) == {
        "block_size", "policy", "prompt_tokens", "trials", "tree", "bandwidth",
        "lookup_size_ratio",
    }
    assert (d["block_size"], d["policy"], d["prompt_tokens"]) == (4, "lru", 64)
    row = d["tree"][0]
    assert set(row) == {
        "cached_blocks", "tree_nodes", "tree_leaves", "path_nodes", "max_siblings", "lookups",
        "store", "evict_per_block",
    }
    assert set(row["lookups"][0]) == {"prompt_tokens", "timing", "ns_per_token"}
    assert set(row["store"]) == {"median_s", "min_s", "max_s"}
    bw = d["bandwidth"]
    for key in ("gather", "store", "memcpy", "copy", "prefill", "gather_gb_s", "store_gb_s",
                "memcpy_gb_s", "copy_gb_s", "gather_vs_prefill", "store_vs_prefill"):
        assert key in bw
    assert d["lookup_size_ratio"] > 0


def test_render_shows_every_row_and_the_ratios(result: CacheBenchResult) -> None:
    text = _render(result)
    for needle in (
        "Cache operations vs cache size", "lookup 16", "lookup 64", "store 64", "evict / block",
        "K/V traffic for 32 tokens", "gather (pool -> K/V)", "store (K/V -> pool)",
        "memcpy (clone)", "copy_ (preallocated)", "prefill 32 tokens", "gather / prefill =",
        "Lookup per prompt token",
    ):
        assert needle in text, needle
    for row in result.tree:
        assert f"{row.cached_blocks:,}" in text


def test_render_without_a_model_says_so(result: CacheBenchResult) -> None:
    bw = result.bandwidth
    no_model = BandwidthResult(**{**bw.__dict__, "prefill": None})
    text = _render(CacheBenchResult(4, "lru", 64, 2, result.tree, no_model))
    assert "no model given" in text and "prefill 32" not in text


def test_bench_tree_honours_the_policy() -> None:
    rows = bench_tree(sizes=(20,), prompt_tokens=16, lengths=(16,), block_size=4,
                      policy="sink-lru", trials=1, evict_batch=2, fill_tokens=8)
    assert len(rows) == 1 and rows[0].cached_blocks >= 5


def test_measure_and_formatting() -> None:
    samples = iter([9.0, 3.0, 1.0, 2.0])
    t = measure(lambda: next(samples), trials=3, warmup=1)
    assert t == Timing(2.0, 1.0, 3.0)
    assert t.per(2) == Timing(1.0, 0.5, 1.5)
    assert (t.median_ms, t.min_ms, t.max_ms) == (2000.0, 1000.0, 3000.0)
    assert t.spread == 0.5
    assert [format_seconds(s) for s in (1234.5, 2.5, 0.2305, 0.0125, 0.00654, 3.2e-5, 4e-8)] == [
        "1,234.50 s", "2.50 s", "230.5 ms", "12.5 ms", "6.54 ms", "32.0 µs", "40 ns",
    ]


def test_measure_falls_back_to_wall_time_and_never_runs_zero_trials() -> None:
    calls: list[int] = []
    t = measure(lambda: calls.append(1), trials=0, warmup=2)
    assert len(calls) == 3  # two warm-ups, then at least one trial
    assert 0 <= t.min_s == t.median_s == t.max_s < 1


def test_timed_returns_the_operations_value() -> None:
    done = timed(lambda: 42)
    assert done.value == 42 and done.seconds >= 0


def test_as_json_writes_each_timing_in_the_unit_asked_for() -> None:
    row = PolicyRow("lru", 1, 2, 1, 1, 0, "synthetic")
    assert as_json([row]) == [{"policy": "lru", "requests": 1, "prompt_tokens": 2,
                               "hit_tokens": 1, "requests_hit": 1, "evictions": 0,
                               "scores": "synthetic"}]
    t = Timing(0.5, 0.25, 1.0)
    assert as_json((t, None), "ms") == [
        {"median_ms": 500.0, "min_ms": 250.0, "max_ms": 1000.0}, None,
    ]
    assert as_json(t) == {"median_s": 0.5, "min_s": 0.25, "max_s": 1.0}


def test_the_bench_views_import_no_bench() -> None:
    """The views render typed results (kvchat.bench.results, torch-free) and import none of
    the code that measures."""
    import ast

    import kvchat.ui.bench_view as view

    tree = ast.parse(open(view.__file__, encoding="utf-8").read())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for a in node.names}
    assert "kvchat.bench.results" in imported
    assert not [m for m in imported if m and m != "kvchat.bench.results" and (
        m == "kvchat.bench" or m.startswith("kvchat.bench."))]
    results = ast.parse(open(view.__file__.replace("ui/bench_view.py", "bench/results.py"),
                             encoding="utf-8").read())
    assert not [node for node in ast.walk(results) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith(("kvchat.bench", "torch"))]
