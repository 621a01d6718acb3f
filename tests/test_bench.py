"""`kvchat bench` subcommands run end to end on the tiny model and print the structure the README
quotes (never asserting times: this machine is shared and noisy)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvchat.bench.commands import bench_app
from kvchat.bench.policies import bench_policies, policy_workload
from kvchat.bench.workloads import (
    KINDS,
    build_workload,
    few_shot_workload,
    ideal_hits,
    ideal_prefill,
    multi_turn_workload,
    repeats_workload,
    shared_prefix,
    shared_system_workload,
    unaligned_workload,
)

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
    [k] = r["kinds"]
    assert k["kind"] == "shared-system" and k["requests"] == 4
    names = [c["name"] for c in k["contenders"]]
    assert names == ["kvchat", "model.generate"]
    kv, gen = k["contenders"]
    assert "batch_size=4 (--batch-size)" in kv["note"]
    # each shared prefix computed once (within a block of slack per request)
    assert k["ideal_prefill_tokens"] <= kv["prefill_tokens"] <= k["ideal_prefill_tokens"] + 4 * 16
    assert kv["prefill_tokens"] + kv["hit_tokens"] == k["prompt_tokens"]
    assert kv["identical_outputs"] == 4 and gen["prefill_tokens"] == k["prompt_tokens"]
    # a skipped peer has no speed-up to report
    assert kv["speedup_vs"]["model.generate"] > 0 and "generate_batch" not in kv["speedup_vs"]


def test_batch_all_kinds(tiny_model_dir):
    r = run_json(["batch", "--kind", "all", "--requests", "4", "--system-tokens", "40",
                  "--new-tokens", "2", "--skip", "generate_batch,generate", "--model",
                  str(tiny_model_dir)])
    assert r["new_tokens"] == 2 and [k["kind"] for k in r["kinds"]] == list(KINDS)
    assert r["torch_threads"] >= 1
    for k in r["kinds"]:
        [kv] = k["contenders"]
        # the automatic batch size, as kvchat batch picks it by default
        assert kv["name"] == "kvchat" and " (auto" in kv["note"]
        assert kv["prefill_tokens"] + kv["hit_tokens"] == k["prompt_tokens"]
        assert kv["identical_outputs"] is None and 0 < kv["reuse"] <= 1.5
    repeats = next(k for k in r["kinds"] if k["kind"] == "repeats")
    # every exact repeat is a full hit; only a few template tokens of a wave's fellows may be lost
    assert repeats["contenders"][0]["reuse"] > 0.9
    res = runner.invoke(bench_app, ["batch", "--kind", "unaligned", "--skip",
                                    "generate,generate_batch", "--new-tokens", "2",
                                    "--model", str(tiny_model_dir)], env={"COLUMNS": "140"})
    assert res.exit_code == 0, res.output
    for text in ("unaligned", "16 lines", "kvchat:", "reuse", "ideal", "ref."):
        assert text in res.stdout
    assert "generate_batch" not in res.stdout  # skipped peers get no column


def test_batch_rejects_unknown_contender_and_kind(tiny_model_dir):
    res = runner.invoke(bench_app, ["batch", "--skip", "vllm", "--model", str(tiny_model_dir)])
    assert res.exit_code != 0 and "unknown contender" in res.output
    res = runner.invoke(bench_app, ["batch", "--kind", "chat", "--model", str(tiny_model_dir)])
    assert res.exit_code != 0 and "unknown --kind" in res.output


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
    a = shared_system_workload(tiny_tokenizer, 5, 80)
    assert a == shared_system_workload(tiny_tokenizer, 5, 80)
    assert len({tuple(p) for p in a}) == 5
    shared = min(len(p) for p in a)
    assert ideal_prefill(a) < sum(len(p) for p in a) - 3 * 80 + shared
    for kind in KINDS:
        assert build_workload(kind, tiny_tokenizer) == build_workload(kind, tiny_tokenizer)
    assert policy_workload(50) == policy_workload(50)
    # pressure: a pool of a fifth of the workload must evict under every policy
    assert all(r.evictions > 0 for r in bench_policies(50, 0.2))


def test_shared_system_and_few_shot_share_their_header(tiny_tokenizer):
    for prompts, n, header in ((shared_system_workload(tiny_tokenizer, 6, 120), 6, 120),
                               (few_shot_workload(tiny_tokenizer, 5, 300), 5, 300)):
        assert len(prompts) == n == len({tuple(p) for p in prompts})
        assert min(shared_prefix(prompts[0], p) for p in prompts[1:]) >= header
    text = tiny_tokenizer.decode(few_shot_workload(tiny_tokenizer, 1, 300)[0])
    assert text.count("<|im_start|>assistant") >= 3  # examples, then the item's answer


def test_multi_turn_lines_extend_their_previous_turn(tiny_tokenizer):
    prompts = multi_turn_workload(tiny_tokenizer, conversations=3, turns=4)
    assert len(prompts) == 12 == len({tuple(p) for p in prompts})
    for i in range(3, 12):  # interleaved: line i is the next turn of line i - 3
        prev, line = prompts[i - 3], prompts[i]
        assert line[:len(prev)] == prev and len(line) > len(prev)
    assert shared_prefix(prompts[0], prompts[1]) < len(prompts[0])  # other chats differ


def test_repeats_are_ten_prompts_three_times_shuffled(tiny_tokenizer):
    prompts = repeats_workload(tiny_tokenizer)
    counts: dict[tuple[int, ...], int] = {}
    for p in prompts:
        counts[tuple(p)] = counts.get(tuple(p), 0) + 1
    assert len(prompts) == 30 and len(counts) == 10 and set(counts.values()) == {3}
    assert prompts != sorted(prompts, key=lambda p: list(counts).index(tuple(p)))
    assert repeats_workload(tiny_tokenizer, seed=1) != prompts


def test_unaligned_groups_share_exactly_47_and_113_tokens(tiny_tokenizer):
    prompts = unaligned_workload(tiny_tokenizer, (47, 113), per_group=5)
    assert len(prompts) == 10
    for group, n in ((prompts[:5], 47), (prompts[5:], 113)):
        assert {shared_prefix(a, b) for i, a in enumerate(group) for b in group[i + 1:]} == {n}
    assert shared_prefix(prompts[0], prompts[5]) < 47


def test_peers_warm_up_on_a_prompt_the_workload_does_not_start_with(tiny_tokenizer):
    """llama-server keeps what it was warmed up on: that prompt must share nothing with the
    timed file, so the peer starts as cold as kvchat's fresh cache."""
    from kvchat.bench.batch import unrelated_prompt
    from kvchat.bench.workloads import KINDS, build_workload

    for kind in KINDS:
        prompts = build_workload(kind, tiny_tokenizer)
        warm = unrelated_prompt(prompts)
        assert warm and all(shared_prefix(warm, p) == 0 for p in prompts)
    assert unrelated_prompt([[1, 5], [2], [3, 3]])[0] == 4


def test_ideal_hits_counts_the_best_earlier_prefix():
    lines = [
        [1, 2, 3, 4],  # nothing earlier: 0
        [1, 2, 3, 9, 9],  # shares 3 with line 0
        [1, 2, 3, 9, 9],  # exact repeat: all 5
        [1, 2, 3],  # a prefix of earlier lines, not a repeat: all but its last token, 2
        [7, 8],  # nothing shared: 0
        [1, 2, 3, 9, 9, 5],  # shares 5 with lines 1 and 2
        [1],  # shares 1, keeps one token to compute: 0
    ]
    assert ideal_hits(lines) == 0 + 3 + 5 + 2 + 0 + 5 + 0
    assert ideal_hits([]) == 0
    assert ideal_prefill(lines) == 4 + 2 + 0 + 0 + 2 + 1 + 0


def test_batch_bench_compares_with_generate_and_the_ideal():
    from kvchat.bench.results import BatchBench, Contender

    ref = Contender("model.generate", 8.0, ((1, 2), (3, 4), (5,)), 30)
    kv = Contender("kvchat", 2.0, ((1, 2), (3, 9), (5,)), 10, 15)
    failed = Contender("generate_batch", None, note="could not run")
    r = BatchBench("repeats", 3, 30, 2, 12, 20, (kv, failed, ref))
    assert r.speedup("model.generate") == 4.0 and r.speedup("generate_batch") is None
    assert r.identical("kvchat") == 2 and r.identical("generate_batch") is None
    assert r.reuse() == 0.75 and r.reuse("model.generate") is None
    row = r.as_dict()["contenders"][0]
    assert row["speedup_vs"] == {"model.generate": 4.0, "generate_batch": None}
    assert row["identical_outputs"] == 2 and row["reuse"] == 0.75


def test_batch_table_lists_each_runners_settings_once():
    from rich.console import Console

    from kvchat.bench.results import BatchBench, BatchSuite, Contender
    from kvchat.ui.bench_view import batch_table

    def kind(name: str, size: int) -> BatchBench:
        ref = Contender("model.generate", 4.0, ((1,), (2,)), 20, note="one request at a time")
        kv = Contender("kvchat", 1.0, ((1,), (3,)), 5, 12, f"batch_size={size} (auto)")
        return BatchBench(name, 2, 20, 1, 6, 12, (kv, ref))

    console = Console(width=140, record=True)
    console.print(batch_table(BatchSuite(1, (kind("few-shot", 8), kind("repeats", 8),
                                             kind("unaligned", 2)))))
    text = console.export_text()
    assert "kvchat: few-shot, repeats: batch_size=8 (auto); unaligned: batch_size=2 (auto)" in text
    assert "model.generate: one request at a time" in text
    assert text.count("1/2") == 3 and text.count("100.0%") == 3 and "4.00x" in text


def test_decode_json_per_precision(tiny_model_dir):
    r = run_json(["decode", "--precisions", "float32,int4", "--rows", "1,3", "--context", "12",
                  "--new-tokens", "6", "--prefill-tokens", "40", "--trials", "2", "--model",
                  str(tiny_model_dir)])
    assert [p["precision"] for p in r["precisions"]] == ["float32", "int4"]
    f32, int4 = r["precisions"]
    assert int4["step_bytes"] < f32["step_bytes"] / 3  # packed weights: fewer bytes per step
    for p in r["precisions"]:
        t = p["decode_s_per_token"]
        assert 0 < t["min_ms"] <= t["median_ms"] <= t["max_ms"]
        assert [row["rows"] for row in p["rows"]] == [1, 3]
        assert all(row["tokens_per_s"] > 0 for row in p["rows"]) and p["prefill_tps"] > 0
        # the repeat's reply is drafted: 6 tokens, the first from stored logits, the other 5
        # verified in one forward
        assert p["repeat_forwards_per_token"] == pytest.approx(1 / 6)
    assert r["llama_cpp"] is None and r["vs_llama_cpp"] == {"float32": None, "int4": None}


def test_decode_llama_cpp_needs_its_binaries(tiny_gguf, tmp_path):
    from kvchat import cli

    res = runner.invoke(cli.app, ["bench", "decode", "--llama-cpp", str(tmp_path), "--model",
                                  str(tiny_gguf), "--trials", "1", "--precisions", "float32"])
    assert res.exit_code == 2 and "No llama-bench in" in res.output
    assert "Traceback" not in res.output


def test_llama_bench_output_is_read(tmp_path):
    """llama-bench's JSON (-o json): a pp row and a tg row, as llama.cpp prints them."""
    from kvchat.bench.llama_cpp import LlamaCpp

    rows = [{"n_prompt": 512, "n_gen": 0, "avg_ts": 281.5}, {"n_prompt": 0, "n_gen": 64,
                                                              "avg_ts": 104.2}]
    script = tmp_path / "bin" / "llama-bench"
    script.parent.mkdir()
    script.write_text(f"#!/bin/sh\necho '{json.dumps(rows)}'\n")
    script.chmod(0o755)
    figures = LlamaCpp(tmp_path).bench(tmp_path / "m.gguf", 512, 64)
    assert (figures.prefill_tps, figures.decode_tps) == (281.5, 104.2)
