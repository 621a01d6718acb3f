"""One rule for text that is not valid Unicode, at every entrance: the line, message or file
that carries it is refused with an error saying where, and the rest goes on (batch files, chat
input, session files; the server's bodies are in test_server_input.py, inspect --explain in
test_inspect_explain.py). A UTF-8 byte order mark before a batch file's first line is dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvchat.batch import read_batch
from kvchat.cli import app
from kvchat.sessions import Session, SessionError, SessionStore
from kvchat.text_input import InvalidText, check_json, check_text, decode_utf8, json_problem

runner = CliRunner()


def model_args(model_dir: Path, root: Path) -> list[str]:
    return ["--model", str(model_dir), "--sessions-dir", str(root), "--max-tokens", "3",
            "--block-size", "4", "--cache-mb", "8"]


def test_the_rule_names_where_the_text_is_bad() -> None:
    assert check_text("café ☕", "x") == "café ☕"
    with pytest.raises(InvalidText, match=r"The line is not valid Unicode: character 5 is a "
                                          r"lone surrogate \(\\ud800\)"):
        check_text("bad \ud800", "The line")
    with pytest.raises(InvalidText, match="byte 0xff at character 7 is not UTF-8"):
        check_text("hello \udcff", "--explain", from_os=True)  # a bad argv byte, as Python has it
    with pytest.raises(InvalidText, match=r"byte 5 is 0xff\); save it as UTF-8"):
        decode_utf8(b"bad \xff\xfe", "This line")
    with pytest.raises(InvalidText, match=r"byte 2 is 0xed"):
        decode_utf8(b'"\xed\xa0\x80"', "This line")  # a surrogate's bytes are not UTF-8
    doc = {"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\udfff"}]}
    assert json_problem(doc) == ("messages[1].content: character 1 is a lone surrogate "
                                 "(\\udfff), which is not a character")
    assert json_problem({"\ud800": 1}) is not None and json_problem(["fine", 3, None]) is None
    with pytest.raises(InvalidText, match=r"the body holds text .*messages\[1\]\.content"):
        check_json(doc, "the body")


def test_a_lone_surrogate_fails_its_line_and_the_rest_runs(tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"prompt":"\\ud800 hi","max_tokens":4}\n{"prompt":"Say hi","max_tokens":4}\n'
                    b'{"messages":[{"role":"user","content":"x\\udc00"}]}\n')
    items, bad = read_batch(src)
    assert [i.line for i in items] == [2]
    assert [b.line for b in bad] == [1, 3]
    assert "prompt: character 1 is a lone surrogate" in bad[0].message
    assert "messages[0].content" in bad[1].message
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["batch", str(src), "-o", str(out), "--batch-size", "2",
                              *model_args(tiny_model_dir, tmp_path / "s")])
    assert res.exit_code == 1, res.output  # a line failed; not a crash
    assert "Traceback" not in res.output and "line 1:" in res.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["line"] for r in rows] == [1, 2, 3]
    assert "not valid Unicode" in rows[0]["error"] and "error" not in rows[1]
    assert rows[1]["completion_tokens"] > 0


def test_a_byte_order_mark_does_not_lose_the_first_line(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'\xef\xbb\xbf{"prompt": "first"}\n{"prompt": "second"}\n')
    items, bad = read_batch(src)
    assert not bad
    assert [(i.line, i.messages[0]["content"]) for i in items] == [(1, "first"), (2, "second")]
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(b'{"prompt": "first"}\n{"prompt": "second"}\n')
    assert items[0].digest == read_batch(plain)[0][0].digest  # --resume sees the same line


def test_chat_from_a_pipe_refuses_a_line_that_is_not_utf8_and_goes_on(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "s"
    res = runner.invoke(app, ["chat", "--session", "p", "--panels", "off",
                              *model_args(tiny_model_dir, root)],
                        input=b"bad \xff\xfe\nSay hi.\n")
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "Traceback" not in out
    assert ("This line is not UTF-8 text (byte 5 is 0xff); save it as UTF-8. Nothing was sent."
            in out)
    saved = json.loads((root / "p.json").read_text())
    assert [m["content"] for m in saved["messages"] if m["role"] == "user"] == ["Say hi."]


def test_chat_refuses_a_system_prompt_that_is_not_unicode(tmp_path: Path) -> None:
    res = runner.invoke(app, ["chat", "--system", "bad \udcff", "--sessions-dir",
                              str(tmp_path / "s"), "--model", "/nonexistent"])
    assert res.exit_code == 2
    assert "The --system text is not valid Unicode" in res.output
    assert not (tmp_path / "s").exists()  # refused before anything is opened


def test_a_session_file_with_a_lone_surrogate_is_set_aside(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = SessionStore(root)
    store.save(Session("ok", messages=[{"role": "user", "content": "fine"}]))
    (root / "bad.json").write_text(json.dumps(
        {"name": "bad", "messages": [{"role": "user", "content": "\ud800"}]}))
    with pytest.raises(SessionError, match=r"not valid Unicode \(messages\[0\]\.content"):
        store.load("bad")
    assert not (root / "bad.json").exists()
    assert list((root / "cache" / "set-aside").glob("*-bad.json"))
    assert store.load("ok").messages[0]["content"] == "fine"
