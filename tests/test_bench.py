"""`kvchat bench` subcommands run end to end on the tiny model and print the structure the README
quotes (never asserting times: this machine is shared and noisy)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

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
from kvchat.cli.bench import bench_app

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
    # both precisions were resident at once: each load's RSS, what it added, its own peak
    assert r["loaded_together"] is True and r["n_params"] > 0 and r["file_bytes"] is None
    assert r["model"] == tiny_model_dir.name
    f32_load, int4_load = f32["load"], int4["load"]
    assert f32_load["rss_before"] >= r["rss_start"] > 0
    assert int4_load["rss_before"] >= f32_load["rss_after"] - 2**20  # float32 still resident
    for load in (f32_load, int4_load):
        assert load["seconds"] > 0
        assert load["added"] == load["rss_after"] - load["rss_before"]
        assert load["peak"] >= load["rss_after"]  # the high-water mark during that load
    assert r["peak_rss"] >= max(f32_load["peak"], int4_load["peak"])


def test_decode_table_shows_one_precisions_load_and_peak(tiny_model_dir):
    res = runner.invoke(bench_app, ["decode", "--precisions", "int8", "--rows", "1,2",
                                    "--context", "8", "--new-tokens", "4", "--prefill-tokens",
                                    "16", "--trials", "1", "--model", str(tiny_model_dir)],
                        env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    text = res.stdout
    assert "load" in text and "RSS loaded" in text and "peak RSS" in text
    row = next(line for line in text.splitlines() if "kvchat int8" in line)
    # one precision: its RSS after load and the run's peak, both in MiB, no "+" (nothing else
    # was resident), and no line about several precisions sharing the process
    assert row.count("MiB") == 3 and "(+" not in row and " s " in row
    assert "held every precision in one process" not in text


def _decode_result(loads, together_peak=900 * 2**20):
    from kvchat.bench.results import (
        DecodeResult,
        LlamaCppDecode,
        LoadCost,
        PrecisionDecode,
        RowsRate,
        Timing,
    )

    t = Timing.of([0.01, 0.012])
    rates = (RowsRate(1, 90.0), RowsRate(8, 300.0))
    precisions = tuple(PrecisionDecode(name, 10 * 2**20, t, rates, 500.0, 0.5,
                                       0.01, LoadCost(1.5, before, after, peak))
                       for name, (before, after, peak) in loads.items())
    peer = LlamaCppDecode(Timing.of([0.008]), 700.0, (RowsRate(1, 110.0), RowsRate(8, 400.0)),
                          bench_peak_rss=300 * 2**20, model_bytes=80 * 2**20,
                          server_load=LoadCost(0.7, None, 350 * 2**20, 420 * 2**20))
    return DecodeResult(64, 64, 512, 3, precisions, peer, "m.gguf", 494_000_000, 400 * 2**20,
                        together_peak, 200 * 2**20)


def test_decode_table_rows_for_several_precisions_and_llama_cpp():
    from rich.console import Console

    from kvchat.ui.decode_view import decode_table

    mib = 2**20
    r = _decode_result({"int8": (200 * mib, 500 * mib, 600 * mib),
                        "int4": (500 * mib, 700 * mib, 750 * mib)})
    console = Console(record=True, width=260)
    console.print(decode_table(r))
    lines = console.export_text().splitlines()
    assert "m.gguf (0.49 B parameters, 400 MiB file)" in " ".join(lines)
    int8 = next(line for line in lines if "kvchat int8" in line)
    int4 = next(line for line in lines if "kvchat int4" in line)
    assert "500 MiB" in int8 and "(+" not in int8  # the first load: nothing else resident
    assert "700 MiB (+200)" in int4  # int8's 500 MiB was still resident
    assert "1.5 s" in int4 and "–" in int4  # no per-row peak when both shared the process
    together = " ".join(lines)
    assert "200 MiB resident before the first load, peak 900 MiB over the run" in together
    bench = next(line for line in lines if "llama.cpp llama-bench" in line)
    server = next(line for line in lines if "llama.cpp llama-server" in line)
    assert "80.0 MiB" in bench and "300 MiB" in bench and "8.00 ms" in bench
    assert "0.7 s" in server and "350 MiB" in server and "420 MiB" in server
    assert "400.0" in server  # 8 requests at once
    data = r.as_dict()
    assert data["precisions"][1]["load"]["added"] == 200 * mib
    assert data["llama_cpp"]["server_load"]["rss_after"] == 350 * mib
    assert data["llama_cpp"]["bench_peak_rss"] == 300 * mib


def test_process_memory_is_read_from_proc():
    from kvchat.bench.llama_cpp import memory_of, reset_peak

    rss, peak = memory_of()
    assert 0 < rss <= peak
    big = bytearray(64 * 2**20)  # touched: resident
    assert memory_of()[1] >= rss + 60 * 2**20
    del big
    if reset_peak():  # the high-water mark falls back to what is resident now
        now, peak = memory_of()
        assert peak <= now + 8 * 2**20
    assert memory_of(2**22 + 12345) is None  # above the kernel's pid limit: no such process


def test_decode_llama_cpp_needs_its_binaries(tiny_gguf, tmp_path):
    from kvchat import cli

    res = runner.invoke(cli.app, ["bench", "decode", "--llama-cpp", str(tmp_path), "--model",
                                  str(tiny_gguf), "--trials", "1", "--precisions", "float32"])
    assert res.exit_code == 2 and "No llama-bench in" in res.output
    assert "Traceback" not in res.output


def test_llama_bench_output_is_read(tmp_path):
    """llama-bench's JSON (-o json): a pp row and a tg row, as llama.cpp prints them."""
    from kvchat.bench.llama_cpp import LlamaCpp

    rows = [{"n_prompt": 512, "n_gen": 0, "avg_ts": 281.5, "model_size": 123456},
            {"n_prompt": 0, "n_gen": 64, "avg_ts": 104.2, "model_size": 123456}]
    script = tmp_path / "bin" / "llama-bench"
    script.parent.mkdir()
    script.write_text(f"#!/bin/sh\nsleep 0.3\necho '{json.dumps(rows)}'\n")
    script.chmod(0o755)
    from kvchat.bench.llama_cpp import memory_of

    ballast = bytearray(128 * 2**20)  # this process's memory, which the child's must not count
    figures = LlamaCpp(tmp_path).bench(tmp_path / "m.gguf", 512, 64)
    assert (figures.prefill_tps, figures.decode_tps) == (281.5, 104.2)
    assert figures.model_bytes == 123456
    # the shell's own high-water mark (a few MiB), not the memory it was spawned from
    assert 0 < figures.peak_rss < 64 * 2**20 < memory_of()[1]
    del ballast


def test_llama_bench_failure_says_why(tmp_path):
    from kvchat.bench.llama_cpp import LlamaCpp, LlamaCppError

    script = tmp_path / "llama-bench"
    script.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 3\n")
    script.chmod(0o755)
    with pytest.raises(LlamaCppError, match="exit status 3.*failed to load model"):
        LlamaCpp(tmp_path).bench(tmp_path / "m.gguf", 512, 64)


FAKE_SERVER = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
hold = bytearray(32 * 2**20)  # resident: its RSS is read at /health

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_llama_server_start_is_timed_and_its_memory_read(tmp_path):
    import sys

    import httpx

    from kvchat.bench.llama_cpp import LlamaCpp

    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    script.chmod(0o755)
    with LlamaCpp(tmp_path).serve(tmp_path / "m.gguf", parallel=2) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        started = server.started
        assert started.seconds > 0 and started.rss_before is None
        assert started.rss_after > 32 * 2**20
        assert server.peak_rss() >= started.rss_after


@pytest.mark.parametrize("dtype", ["int4", "float32"])
def test_every_kind_of_batch_gives_generates_texts(tiny_model_dir, dtype):
    """The invariance check of every bench kind: kvchat's batched, cached, drafted lines (at the
    automatic batch size and at 1) equal plain `generate` one by one, line for line."""
    for batch in ([], ["--batch-size", "1"]):
        r = run_json(["batch", "--kind", "all", "--requests", "6", "--system-tokens", "40",
                      "--new-tokens", "6", "--skip", "generate_batch", "--dtype", dtype,
                      "--model", str(tiny_model_dir), *batch])
        for k in r["kinds"]:
            kv, gen = k["contenders"]
            assert (kv["name"], gen["name"]) == ("kvchat", "model.generate")
            assert kv["identical_outputs"] == k["requests"], (k["kind"], batch)
