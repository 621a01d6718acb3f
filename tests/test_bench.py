"""`kvchat bench` subcommands run end to end on the tiny model and print the structure the README
quotes (never asserting times: this machine is shared and noisy)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvchat.bench.batch import ideal_prefill, shared_prompt_workload
from kvchat.bench.commands import bench_app
from kvchat.bench.policies import bench_policies, policy_workload

runner = CliRunner()


def run_json(args: list[str]) -> object:
    res = runner.invoke(bench_app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_ttft_json(tiny_model_dir):
    rows = run_json(["ttft", "--lengths", "16,40", "--trials", "1", "--model", str(tiny_model_dir)])
    assert [r["prompt_tokens"] for r in rows] == [16, 40]
    for r in rows:
        for key in ("cold", "warm", "exact", "decode_step"):
            assert r[key]["min_ms"] <= r[key]["median_ms"] <= r[key]["max_ms"]
        assert r["warm_vs_decode"] > 0 and r["exact_vs_decode"] > 0


def test_ttft_table_and_plot(tiny_model_dir, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "ttft.png"
    res = runner.invoke(bench_app, ["ttft", "--lengths", "16", "--trials", "1", "--model",
                                    str(tiny_model_dir), "--plot", str(plot)])
    assert res.exit_code == 0, res.output
    assert "Time to first token" in res.stdout and "exact/step" in res.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_overhead_json(tiny_model_dir):
    r = run_json(["overhead", "--prompt-tokens", "24", "--new-tokens", "4", "--trials", "1",
                  "--model", str(tiny_model_dir)])
    assert r["prompt_tokens"] == 24 and r["new_tokens"] == 4
    assert r["kvchat_decode_tps"] > 0 and r["generate_decode_tps"] > 0
    assert "miss_overhead" in r and "decode_ratio" in r
    assert len(r["h2o_prefill_ratios"]) == 1 and r["h2o_prefill_ratio"] > 0


def test_cache_json(tiny_model_dir):
    r = run_json(["cache", "--sizes", "50,200", "--prompt-tokens", "128", "--trials", "2",
                  "--model", str(tiny_model_dir)])
    assert isinstance(r, dict) and r


def test_batch_json(tiny_model_dir):
    r = run_json(["batch", "--requests", "4", "--system-tokens", "40", "--new-tokens", "3",
                  "--batch-size", "4", "--skip", "generate_batch", "--model",
                  str(tiny_model_dir)])
    names = [c["name"] for c in r["contenders"]]
    assert names == ["kvchat", "model.generate"]
    kv = r["contenders"][0]
    # each shared prefix computed once (within a block of slack per request)
    assert r["ideal_prefill_tokens"] <= kv["prefill_tokens"] <= r["ideal_prefill_tokens"] + 4 * 16


def test_batch_rejects_unknown_contender(tiny_model_dir):
    res = runner.invoke(bench_app, ["batch", "--skip", "vllm", "--model", str(tiny_model_dir)])
    assert res.exit_code != 0 and "unknown contender" in res.output


def test_multiturn_json(tiny_model_dir):
    rows = run_json(["multiturn", "--turns", "3", "--max-tokens", "4", "--model",
                     str(tiny_model_dir)])
    assert [r["turn"] for r in rows] == [1, 2, 3]
    assert rows[0]["hit_tokens"] < rows[0]["prompt_tokens"]
    assert all(r["hit_tokens"] > 0 for r in rows[1:])


def test_policies_simulation_and_model(tiny_model_dir):
    rows = run_json(["policies", "--requests", "60", "--pool-fraction", "0.2"])
    assert [r["policy"] for r in rows] == ["lru", "sink-lru", "h2o"]
    assert all(r["evictions"] > 0 and r["scores"] == "synthetic" for r in rows)
    rows = run_json(["policies", "--requests", "12", "--pool-fraction", "0.3", "--with-model",
                     "--model", str(tiny_model_dir)])
    assert all(r["scores"] == "model" for r in rows)


def test_workloads_are_deterministic(tiny_tokenizer):
    a = shared_prompt_workload(tiny_tokenizer, 5, 80)
    assert a == shared_prompt_workload(tiny_tokenizer, 5, 80)
    assert len({tuple(p) for p in a}) == 5
    shared = min(len(p) for p in a)
    assert ideal_prefill(a) < sum(len(p) for p in a) - 3 * 80 + shared
    assert policy_workload(50) == policy_workload(50)
    # pressure: a pool of a fifth of the workload must evict under every policy
    assert all(r.evictions > 0 for r in bench_policies(50, 0.2))
