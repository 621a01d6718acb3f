"""`kvchat batch` end to end through the CLI on the tiny model."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvchat.cli import app
from kvchat.snapshots import read_snapshot_meta

runner = CliRunner()


def args(tiny_model_dir, tmp_path, *extra: str) -> list[str]:
    return [*extra, "--model", str(tiny_model_dir), "--sessions-dir", str(tmp_path / "s"),
            "--max-tokens", "4", "--block-size", "4", "--cache-mb", "16"]


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
    assert rows[2]["response"]["body"]["usage"]["completion_tokens"] <= 2
    assert "hit rate" in res.output and "prefill computed / total" in res.output
    meta = read_snapshot_meta(tmp_path / "s")
    assert meta is not None and meta.cached_tokens > 0


def test_bad_lines_are_skipped_and_fail_the_exit_code(tiny_model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "fine"}\n{"prompt": 3}\nnot json\n{"prompt": "also fine"}\n')
    res = runner.invoke(app, ["batch", str(src), *args(tiny_model_dir, tmp_path)])
    assert res.exit_code == 1
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert [("error" in r) for r in lines] == [False, True, True, False]
    assert lines[1]["line"] == 2 and "must be a string" in lines[1]["error"]
    assert "line 3:" in res.output


def test_fail_fast_and_empty_file(tiny_model_dir, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    res = runner.invoke(app, ["batch", str(src), "--fail-fast", *args(tiny_model_dir, tmp_path)])
    assert res.exit_code == 1 and "line 2" in res.output
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    res = runner.invoke(app, ["batch", str(empty), *args(tiny_model_dir, tmp_path)])
    assert res.exit_code == 2 and "empty" in res.output and "Traceback" not in res.output
