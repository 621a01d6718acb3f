"""`kvchat batch` end to end through the CLI on the tiny model."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvchat.cli import app
from kvchat.snapshots import read_snapshot_meta

runner = CliRunner()


def args(tiny_model_dir, tmp_path, *extra: str, max_tokens: int = 4) -> list[str]:
    return [*extra, "--model", str(tiny_model_dir), "--sessions-dir", str(tmp_path / "s"),
            "--max-tokens", str(max_tokens), "--block-size", "4", "--cache-mb", "16"]


def test_batch_writes_results_in_order_and_saves_the_cache(tiny_model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [
        {"id": "a", "system": "Be brief.", "prompt": "One?"},
        {"id": "b", "system": "Be brief.", "prompt": "Two?"},
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Three?"}], "max_tokens": 2}},
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["batch", str(src), "-o", str(out),
                              *args(tiny_model_dir, tmp_path, "--batch-size", "2")])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r.get("id") for r in rows[:2]] == ["a", "b"] and rows[2]["custom_id"] == "c"
    assert rows[1]["cache_hit_tokens"] > 0  # the shared system prompt
    # row b leaves row a's text after the system prompt they share: normal, and labelled so
    assert (rows[1]["miss_reason"], rows[1]["miss_label"]) == ("diverged", "shared prefix")
    assert (rows[0]["miss_reason"], rows[0]["miss_label"]) == ("cold", "cold")
    assert rows[2]["response"]["body"]["usage"]["completion_tokens"] <= 2
    assert "hit rate" in res.output and "prefill computed / total" in res.output
    assert "batch size" in res.output and "2" in res.output
    meta = read_snapshot_meta(tmp_path / "s")
    assert meta is not None and meta.cached_tokens > 0


def test_a_repeated_line_replays_its_twins_reply_and_the_summary_says_so(tiny_model_dir,
                                                                         tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "Again?"}\n{"prompt": "Other?"}\n{"prompt": "Again?"}\n')
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["batch", str(src), "-o", str(out),
                              *args(tiny_model_dir, tmp_path, "--max-tokens", "6")])
    assert res.exit_code == 0, res.output
    first, _, again = [json.loads(x) for x in out.read_text().splitlines()]
    assert again["text"] == first["text"] and first["replayed_tokens"] == 0
    assert again["hit_source"] == "exact"
    assert again["replayed_tokens"] == again["completion_tokens"] > 0
    assert "replies replayed" in res.output
    assert f"1 ({again['replayed_tokens']} tok, no forward)" in res.output


def test_the_batch_size_is_chosen_automatically_by_default(tiny_model_dir, tmp_path,
                                                            monkeypatch):
    from kvchat.engine import autobatch

    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "kvchat-cache"))  # nothing measured yet
    # steady timings: a busy test machine's noisy sweep would (rightly) not be kept
    steady = {1: 0.01, 2: 0.01, 4: 0.011, 8: 0.012, 16: 0.014, 32: 0.02, 64: 0.035}
    monkeypatch.setattr(autobatch, "measure_steps", lambda runner, sizes=(): dict(steady))
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    res = runner.invoke(app, ["batch", str(src), *args(tiny_model_dir, tmp_path)])
    assert res.exit_code == 0, res.output
    flat = " ".join(res.output.split())
    assert "batch size" in flat and "(auto: measured now" in flat
    res = runner.invoke(app, ["batch", str(src), *args(tiny_model_dir, tmp_path)])
    assert "(auto: measured earlier" in " ".join(res.output.split())
    bad = runner.invoke(app, ["batch", str(src), "--batch-size", "0",
                              *args(tiny_model_dir, tmp_path)])
    assert bad.exit_code == 2 and "--batch-size must be a positive number or auto" in bad.output


def test_bad_lines_are_skipped_and_fail_the_exit_code(tiny_model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "fine"}\n{"prompt": 3}\nnot json\n{"prompt": "also fine"}\n')
    res = runner.invoke(app, ["batch", str(src), *args(tiny_model_dir, tmp_path)])
    assert res.exit_code == 1
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert [("error" in r) for r in lines] == [False, True, True, False]
    assert lines[1]["line"] == 2 and "must be a string" in lines[1]["error"]
    assert "line 3:" in res.output
    # the progress bar counts the bad lines as the summary does
    assert "4/4" in res.output and "2 failed" in res.output, res.output
    assert "2 finished, 2 failed" in res.output


def test_fail_fast_and_empty_file(tiny_model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    res = runner.invoke(app, ["batch", str(src), "--fail-fast", *args(tiny_model_dir, tmp_path)])
    assert res.exit_code == 1 and "line 2" in res.output
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    res = runner.invoke(app, ["batch", str(empty), *args(tiny_model_dir, tmp_path)])
    assert res.exit_code == 2 and "empty" in res.output and "Traceback" not in res.output


# ---- nothing lost: SIGKILL, SIGTERM, --resume, bad values --------------------------------


def _request_file(tmp_path, n: int = 12):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{k}", "prompt": f"Question number {k}?"}) + "\n"
                           for k in range(n)))
    return src


def _spawn(tiny_model_dir, tmp_path, src, out, *extra: str):
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kvchat", "batch", str(src), "-o", str(out), "--model",
           str(tiny_model_dir), "--sessions-dir", str(tmp_path / "s"), "--block-size", "4",
           "--cache-mb", "16", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ.copy())


def _wait_rows(out, proc, n: int, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out.exists() and len(out.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} rows after {timeout} s")


def _rows(out) -> list[dict]:
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_sigkill_loses_no_finished_row_and_resume_finishes(tiny_model_dir, tmp_path):
    import signal

    src, out = _request_file(tmp_path), tmp_path / "out.jsonl"
    # batch size 1 and long replies: rows finish one by one, so the kill lands mid-run
    proc = _spawn(tiny_model_dir, tmp_path, src, out, "--batch-size", "1", "--max-tokens", "40")
    _wait_rows(out, proc, 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    before = [json.loads(x) for x in out.read_text().splitlines() if x.endswith("}")]
    assert 2 <= len(before) < 12 and all(r["finish_reason"] in ("stop", "length")
                                         for r in before)
    res = runner.invoke(app, ["batch", str(src), "-o", str(out), "--resume",
                              *args(tiny_model_dir, tmp_path, "--batch-size", "4",
                                    max_tokens=40)])
    assert res.exit_code == 0, res.output
    after = _rows(out)
    assert [r["line"] for r in after] == list(range(1, 13))  # one row per line, input order
    kept = {r["line"]: r for r in after}
    assert all(kept[r["line"]] == r for r in before), "finished rows are kept as they were"
    assert f"{len(before)} of 12 line(s) already finished" in " ".join(res.output.split())


def test_resume_refuses_an_output_whose_lines_changed(tiny_model_dir, tmp_path):
    src, out = _request_file(tmp_path, 3), tmp_path / "out.jsonl"
    assert runner.invoke(app, ["batch", str(src), "-o", str(out),
                               *args(tiny_model_dir, tmp_path)]).exit_code == 0
    src.write_text(src.read_text().replace("number 1?", "number one?"))
    res = runner.invoke(app, ["batch", str(src), "-o", str(out), "--resume",
                              *args(tiny_model_dir, tmp_path)])
    assert res.exit_code == 2 and "line 2" in res.output and "Traceback" not in res.output


def test_sigterm_writes_a_row_for_every_line_and_saves_the_cache(tiny_model_dir, tmp_path):
    import signal

    src, out = _request_file(tmp_path), tmp_path / "out.jsonl"
    proc = _spawn(tiny_model_dir, tmp_path, src, out, "--batch-size", "1", "--max-tokens", "40")
    _wait_rows(out, proc, 1)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    rows = _rows(out)
    assert [r["line"] for r in rows] == list(range(1, 13))
    finished = [r for r in rows if r.get("finish_reason") in ("stop", "length")]
    unfinished = [r for r in rows if r not in finished]
    assert finished and unfinished
    assert all(r.get("status") == "not_started" or r.get("finish_reason") == "interrupted"
               for r in unfinished)
    assert "Traceback" not in output and "--resume" in output
    # the summary and the paragraph count what the rows say, a cut-short reply apart
    flat = " ".join(output.split())
    cut = sum(r.get("finish_reason") == "interrupted" for r in rows)
    waiting = sum(r.get("status") == "not_started" for r in rows)
    said = f"requests {len(finished)} finished, 0 failed"
    said += f", {cut} cut short" if cut else ""
    said += f", {waiting} not started" if waiting else ""
    assert said in flat, flat
    assert f"Interrupted: {len(finished)} line(s) finished" in flat
    meta = read_snapshot_meta(tmp_path / "s")
    assert meta is not None and meta.cached_tokens > 0


def test_bad_sampling_values_fail_their_own_line_only(tiny_model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        json.dumps({"prompt": "fine"}),
        json.dumps({"prompt": "tiny", "temperature": 1e-40}),
        '{"prompt": "nan", "temperature": NaN}',
        json.dumps({"prompt": "seed", "seed": 2**70}),
        json.dumps({"prompt": "also fine"}),
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["batch", str(src), "-o", str(out), *args(tiny_model_dir, tmp_path)])
    assert res.exit_code == 1 and "Traceback" not in res.output
    rows = _rows(out)
    assert [("error" in r) for r in rows] == [False, True, True, True, False]
    assert "temperature" in rows[1]["error"] and "seed" in rows[3]["error"]
    assert "line 2:" in res.output


def test_pin_system_pins_each_distinct_system_prompt_and_rows_say_why(tiny_model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [
        {"id": "a", "system": "You are the first helper.", "prompt": "One?"},
        {"id": "b", "system": "You are the first helper.", "prompt": "Two?"},
        {"id": "c", "messages": [{"role": "system", "content": "You are the second one."},
                                 {"role": "user", "content": "Three?"}]},
        {"id": "d", "prompt": "No system prompt here."},
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["batch", str(src), "-o", str(out), "--pin-system",
                              *args(tiny_model_dir, tmp_path, "--batch-size", "1")])
    assert res.exit_code == 0, res.output
    assert "2 distinct system prompt(s) pinned" in " ".join(res.output.split())
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["a"]["miss_reason"] == "cold" and rows["a"]["diverged_at"] is None
    # b shares a's system prompt, then its question differs from what a cached
    assert rows["b"]["miss_reason"] == "diverged" and rows["b"]["diverged_at"] > 0
    assert "diverged at token" in rows["b"]["miss_detail"]
    meta = read_snapshot_meta(tmp_path / "s")
    assert meta is not None
    assert sorted(p["label"] for p in meta.meta["pins"]) == [
        "system prompt of line 1", "system prompt of line 3"]
    assert any(r.get("pinned") for r in meta.meta["tree"])
    shown = runner.invoke(app, ["inspect", "--sessions-dir", str(tmp_path / "s")])
    assert shown.exit_code == 0 and " pinned " in shown.output


def test_pin_system_over_max_pinned_is_reported_and_the_run_goes_on(tiny_model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "system": "You are the first helper.",
                               "prompt": "One?"}) + "\n")
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["batch", str(src), "-o", str(out), "--pin-system",
                              "--max-pinned", "0", *args(tiny_model_dir, tmp_path)])
    assert res.exit_code == 0, res.output
    flat = " ".join(res.output.split())
    assert "line 1's system prompt not pinned:" in flat and "--max-pinned" in flat
    assert "--pin-system: nothing pinned" in flat
    assert len(out.read_text().splitlines()) == 1


def test_a_file_run_again_later_gets_exact_hits(tiny_model_dir, tmp_path):
    # each run is a new process's cache: exact entries saved by an earlier run and not hit
    # since must be saved again, not lost, so the first file's rerun is exact throughout
    first, other = tmp_path / "first.jsonl", tmp_path / "other.jsonl"
    first.write_text('{"system": "Be brief.", "prompt": "One?"}\n'
                     '{"system": "Be brief.", "prompt": "Two?"}\n')
    other.write_text('{"prompt": "Something else entirely"}\n')
    for path in (first, other, first):
        out = tmp_path / f"{path.stem}.out"
        res = runner.invoke(app, ["batch", str(path), "-o", str(out),
                                  *args(tiny_model_dir, tmp_path, "--batch-size", "2")])
        assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "first.out").read_text().splitlines()]
    assert [(r["hit_source"], r["cache_hit_tokens"] == r["prompt_tokens"]) for r in rows] == [
        ("exact", True), ("exact", True)]
    # their replies were saved with the exact entries: this process replays them
    assert all(r["replayed_tokens"] == r["completion_tokens"] > 0 for r in rows)
    assert "replies replayed" in res.output
    listed = json.loads(runner.invoke(app, ["inspect", "--json", "--sessions-dir",
                                            str(tmp_path / "s")]).output)["exact"]
    assert len(listed) == 3  # both files' prompts
    assert len(list((tmp_path / "s" / "cache" / "exact").glob("*.safetensors"))) == 3


def test_a_lines_own_max_tokens_wins_and_the_help_and_summary_say_so(tiny_model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "one", "max_tokens": 2}\n{"prompt": "two", "max_tokens": 2}\n'
                   '{"prompt": "three"}\n')
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["batch", str(src), "-o", str(out),
                              *args(tiny_model_dir, tmp_path, "--batch-size", "2",
                                    max_tokens=5)])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["completion_tokens"] for r in rows] == [2, 2, 5]
    flat = " ".join(res.output.split())
    assert "max tokens 5 (--max-tokens) for 1 line(s); 2 line(s) set their own, which wins: 2" \
        in flat
    help_text = " ".join(runner.invoke(app, ["batch", "--help"]).output.replace("│", " ").split())
    assert "a line's own max_tokens wins over this" in help_text


def test_a_full_disk_for_sessions_reports_every_failed_save_and_fails_the_run(
    tiny_model_dir, tmp_path, monkeypatch
):
    import errno

    import kvchat.sessions as sessions_module

    real_write = sessions_module.atomic_write
    saves = {"beta": 0}

    def disk_full_for_beta(path, data, what="a file"):
        if path.name == "beta.json":
            saves["beta"] += 1
            if saves["beta"] > 2:  # the disk fills up after beta's second turn
                raise sessions_module.write_error(what, path, OSError(errno.ENOSPC, "full"))
        return real_write(path, data, what)

    monkeypatch.setattr(sessions_module, "atomic_write", disk_full_for_beta)
    src = tmp_path / "in.jsonl"
    lines = [{"session": name, "prompt": f"{name} turn {i}"} for i in range(4)
             for name in ("alpha", "beta")]
    src.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["batch", str(src), "-o", str(out), "--batch-size", "2",
                              *args(tiny_model_dir, tmp_path)], terminal_width=200)
    assert res.exit_code == 1, res.output  # every row is written, but the run was not clean
    text = " ".join(res.output.split())
    beta_lines = [n for n, r in enumerate(lines, 1) if r["session"] == "beta"]
    for line in beta_lines[2:]:  # each failed save, by its line
        assert f"line {line}: Could not write session 'beta'" in text
    assert "at the end of the run: Could not write session 'beta'" in text  # tried once more
    assert "sessions behind beta (2 of 4 turns on disk)" in text
    assert "Session beta is behind on disk (2 of 4 turns on disk)" in text
    assert "alpha" not in text.split("sessions behind", 1)[1].split("evictions")[0]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 8 and all("error" not in r for r in rows)
    root = tmp_path / "s"
    assert len(json.loads((root / "beta.json").read_text())["turns"]) == 2
    assert len(json.loads((root / "alpha.json").read_text())["turns"]) == 4


def test_a_reader_that_goes_away_ends_the_batch_quietly(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    src = tmp_path / "in.jsonl"
    # rows of 4 KB: more than a pipe holds, so some write must meet the closed pipe
    src.write_text("".join(json.dumps({"id": f"{i}-" + "x" * 4000, "prompt": f"question {i}"})
                           + "\n" for i in range(40)))
    # as `kvchat batch in.jsonl | head -1`: the reader takes one row, then closes the pipe
    proc = subprocess.Popen([sys.executable, "-m", "kvchat", "batch", str(src),
                             "--batch-size", "1", *args(tiny_model_dir, tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err  # as a tool killed by SIGPIPE
    assert json.loads(first)["line"] == 1
    said = " ".join(err.split())
    for noise in ("Error", "Traceback", "free some space", "--resume", "BrokenPipe",
                  "Exception ignored", "kvchat batch"):  # the summary's title included
        assert noise not in said, said
    meta = read_snapshot_meta(tmp_path / "s")
    assert meta is not None and meta.cached_tokens > 0  # the cache was still saved
