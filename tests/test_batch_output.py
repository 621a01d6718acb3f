"""Batch output rows survive crashes: appended as they finish, rewritten in input order at the
end, read back by --resume (which refuses changed lines), and a full disk is a clear error."""

from __future__ import annotations

import errno
import io
import json

import pytest
from typer.testing import CliRunner

from kvchat.batch import (
    BadLine,
    OutputError,
    RowWriter,
    bad_line_row,
    duplicate_ids,
    is_complete,
    previous_rows,
    read_batch,
)
from kvchat.cli import app


def rows_of(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def done_row(line: int, digest: str, reason: str = "stop") -> dict:
    return {"id": f"q{line}", "line": line, "input_digest": digest, "text": "ok",
            "finish_reason": reason}


def test_rows_are_appended_as_they_finish_and_sorted_at_the_end(tmp_path):
    out = tmp_path / "out.jsonl"
    writer = RowWriter([1, 2, 3], out)
    writer.write(3, done_row(3, "c"))
    # before the end (a SIGKILL here), the finished row is already on disk
    assert [r["line"] for r in rows_of(out)] == [3]
    writer.write(1, done_row(1, "a"))
    writer.write(2, done_row(2, "b"))
    assert [r["line"] for r in rows_of(out)] == [3, 1, 2]
    writer.close()
    assert [r["line"] for r in rows_of(out)] == [1, 2, 3]
    assert not list(tmp_path.glob(".*.tmp"))


def test_stdout_rows_come_in_input_order_as_soon_as_they_can():
    buf = io.StringIO()
    writer = RowWriter([1, 4, 7], None, buf)
    writer.write(4, done_row(4, "b"))
    assert buf.getvalue() == ""  # line 1 is not done: line 4 waits
    writer.write(1, done_row(1, "a"))
    assert [json.loads(x)["line"] for x in buf.getvalue().splitlines()] == [1, 4]
    writer.write(7, done_row(7, "c"))
    writer.close()
    assert [json.loads(x)["line"] for x in buf.getvalue().splitlines()] == [1, 4, 7]


def test_resume_keeps_finished_rows_and_reruns_the_rest(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n{"prompt": "d"}\n')
    items, _ = read_batch(src)
    d = {i.line: i.digest for i in items}
    out = tmp_path / "out.jsonl"
    out.write_text("\n".join(json.dumps(r) for r in [
        done_row(1, d[1]),
        done_row(2, d[2], "interrupted"),  # cut off: runs again
        {"id": "q3", "line": 3, "input_digest": d[3], "status": "not_started", "error": "x"},
    ]) + '\n{"id": "q4", "line": 4, "inp')  # a row torn by a SIGKILL
    kept = previous_rows(out, items)
    assert sorted(kept) == [1]
    # resuming appends, then puts every line in order
    writer = RowWriter([1, 2, 3, 4], out, keep=kept)
    for line in (4, 2, 3):
        writer.write(line, done_row(line, d[line]))
    writer.close()
    assert [r["line"] for r in rows_of(out)] == [1, 2, 3, 4]
    assert all(is_complete(r) for r in rows_of(out))


def test_resume_refuses_a_changed_line(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "a"}\n')
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(done_row(1, "0123456789abcdef")) + "\n")
    items, _ = read_batch(src)
    with pytest.raises(OutputError, match="line 1.*not the same"):
        previous_rows(out, items)


def test_a_full_disk_is_a_clear_error_and_keeps_what_was_written(tmp_path, monkeypatch):
    out = tmp_path / "out.jsonl"
    writer = RowWriter([1, 2], out)
    writer.write(1, done_row(1, "a"))
    assert writer._fh is not None

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer._fh, "write", full)
    with pytest.raises(OutputError, match="No space left on device.*--resume"):
        writer.write(2, done_row(2, "b"))
    assert [r["line"] for r in rows_of(out)] == [1]


def test_openai_error_rows_keep_their_custom_id():
    row = bad_line_row(BadLine(5, "unknown field(s): x", "d", "req-5"))
    assert row["custom_id"] == "req-5" and row["response"] is None
    assert row["error"]["message"] == "unknown field(s): x" and row["line"] == 5
    plain = bad_line_row(BadLine(6, "invalid JSON", "e"))
    assert plain == {"id": "line-6", "line": 6, "input_digest": "e", "error": "invalid JSON"}


def test_duplicate_ids_are_found(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "x"}\n{"prompt": "y"}\n{"id": "a", "prompt": "z"}\n'
                   '{"custom_id": "c", "body": {"messages": [{"role": "user", "content": "q"}]}}\n')
    items, _ = read_batch(src)
    assert duplicate_ids(items) == {"a": [1, 3]}


def test_a_second_run_on_the_same_output_is_refused_until_the_first_has_let_go(tmp_path):
    out = tmp_path / "out.jsonl"
    first = RowWriter([1, 2], out)
    first.write(2, done_row(2, "b"))
    with pytest.raises(OutputError, match="Another kvchat batch is writing .*another -o file"):
        RowWriter([1, 2], out)
    first.write(1, done_row(1, "a"))
    assert first.file is not None
    first.file.rewrite(['{"line": 1}\n', '{"line": 2}\n'])  # renamed into place, still held
    with pytest.raises(OutputError, match="Another kvchat batch"):
        RowWriter([1, 2], out, keep={1: done_row(1, "a")})
    first.close()
    assert [r["line"] for r in rows_of(out)] == [1, 2]
    second = RowWriter([1], out)  # now free: a new run starts from an empty file
    second.write(1, done_row(1, "c"))
    second.close()
    assert [r["text"] for r in rows_of(out)] == ["ok"] and len(rows_of(out)) == 1
    assert not list(tmp_path.glob(".*.tmp"))


def test_batch_refuses_an_output_another_run_writes_before_it_loads_anything(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "a"}\n')
    out = tmp_path / "out.jsonl"
    kept = done_row(1, "x")
    out.write_text(json.dumps(kept) + "\n")
    other = RowWriter([1], out, keep={1: kept})  # another kvchat batch, mid-run
    try:
        res = CliRunner().invoke(app, ["batch", str(src), "-o", str(out), "--model",
                                       "/nonexistent", "--sessions-dir", str(tmp_path / "s")])
    finally:
        other.close()
    assert res.exit_code == 2
    assert "Another kvchat batch is writing" in " ".join(res.output.split())
    assert [r["id"] for r in rows_of(out)] == ["q1"]  # the other run's rows are untouched
    assert not (tmp_path / "s").exists()


def test_an_output_held_but_never_written_is_left_as_it_was(tmp_path):
    from kvchat.batch import OutputFile

    new = tmp_path / "new.jsonl"
    OutputFile.hold(new).close()  # e.g. --fail-fast stopped the run before its first row
    assert not new.exists()
    old = tmp_path / "old.jsonl"
    old.write_text('{"line": 1}\n')
    OutputFile.hold(old).close()
    assert old.read_text() == '{"line": 1}\n'
