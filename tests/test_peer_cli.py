"""kvchat's front ends on a remote engine (`--connect` to an OpenAI-compatible server that is not
kvchat), against the stand-in engine of tests/_fake_peer.py: batch rows from what the engine
reported, in cache-aware order, and --resume after it went away; the chat REPL with sessions
kept here and panels labelled as the engine's reports; inspect and --explain from this
client's record. tests/test_llama_server.py runs the same against a real llama-server."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

from _fake_peer import FakePeer
from rich.console import Console
from test_chat_commands import Script
from typer.testing import CliRunner

from kvchat.chat.peer import PeerBackend
from kvchat.chat.repl import Chat
from kvchat.cli import app as cli_app
from kvchat.client.ledger import Ledger, ledger_path
from kvchat.client.openai_http import OpenAIClient
from kvchat.client.peers import detect
from kvchat.config import SamplingParams
from kvchat.sessions import Session, SessionStore

WIDE = {"COLUMNS": "200"}
FEW_SHOT = "You answer questions about {}. Examples: Q: what is it? A: it is wide and old."


def few_shot_file(path: Path, topics: tuple[str, ...] = ("the sea", "deserts"), each: int = 3,
                  interleaved: bool = False) -> Path:
    lines = [{"id": f"{t}-{q}", "system": FEW_SHOT.format(t), "prompt": f"question {q}?",
              "max_tokens": 3} for t in topics for q in range(each)]
    if interleaved:
        lines = [lines[t * each + q] for q in range(each) for t in range(len(topics))]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def batch(fake: FakePeer, file: Path, out: Path, sessions: Path, *more: str):
    return CliRunner().invoke(cli_app, ["batch", str(file), "-o", str(out), "--connect",
                                        fake.url, "--sessions-dir", str(sessions), *more],
                              env=WIDE)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def cached_share(found: list[dict]) -> float:
    return sum(r["cache_hit_tokens"] for r in found) / sum(r["prompt_tokens"] for r in found)


def test_batch_rows_are_what_the_engine_reported_in_cache_aware_order(tmp_path: Path) -> None:
    file = few_shot_file(tmp_path / "lines.jsonl")
    with FakePeer("vllm") as fake:
        done = batch(fake, file, tmp_path / "out.jsonl", tmp_path / "s", "--concurrency", "3")
        events = list(fake.arrivals)
    assert done.exit_code == 0, done.output
    found = rows(tmp_path / "out.jsonl")
    assert [r["line"] for r in found] == [1, 2, 3, 4, 5, 6]
    assert set(found[0]) == {"id", "line", "input_digest", "text", "prompt_tokens",
                             "completion_tokens", "cache_hit_tokens", "finish_reason",
                             "ttft_ms", "total_ms", "engine"}  # no kvchat-only fields
    assert found[0]["engine"] == "vLLM" and found[0]["text"] == "the sea is"
    # each group's first line went alone: nothing of its group arrived before its prefill
    for topic in ("the sea", "deserts"):
        mine = [(what, i) for i, (_, what, msgs) in enumerate(events)
                if topic in msgs[0]["content"]]
        assert mine[0][0] == "arrived" and mine[1][0] == "prefilled"
    leaders = [r for r in found if r["cache_hit_tokens"] < r["prompt_tokens"] / 2]
    assert [r["line"] for r in leaders] == [1, 4]  # the rest hit the prefix their leader left
    assert "order" in done.output and "cache-aware: 2 shared-prefix group(s) of 6 lines" in \
        " ".join(done.output.split())
    assert "at most 3" in done.output


def test_input_order_sends_a_group_at_once_and_caches_less(tmp_path: Path) -> None:
    file = few_shot_file(tmp_path / "lines.jsonl")
    shares = {}
    for order in ("input", "cache-aware"):
        with FakePeer("sglang") as fake:
            done = batch(fake, file, tmp_path / f"{order}.jsonl", tmp_path / order,
                         "--order", order, "--concurrency", "3")
            assert done.exit_code == 0, done.output
            shares[order] = cached_share(rows(tmp_path / f"{order}.jsonl"))
    assert shares["cache-aware"] > shares["input"] + 0.2


def test_a_llama_cpp_group_runs_line_after_line_in_one_slot(tmp_path: Path) -> None:
    file = few_shot_file(tmp_path / "lines.jsonl", interleaved=True)
    with FakePeer("llamacpp") as fake:
        done = batch(fake, file, tmp_path / "out.jsonl", tmp_path / "s")
        most = fake.most_running
        arrived = [msgs[0]["content"] for _, what, msgs in fake.arrivals if what == "arrived"]
    assert done.exit_code == 0, done.output
    assert most <= 2  # its two slots (/props total_slots) are the default concurrency
    sea = [i for i, c in enumerate(arrived) if "the sea" in c]
    assert len(sea) == 3
    assert "one after another (its slot keeps the prefix)" in " ".join(done.output.split())


def test_an_engine_that_goes_away_loses_no_row_and_resume_finishes(tmp_path: Path) -> None:
    file = few_shot_file(tmp_path / "lines.jsonl", each=4)
    out = tmp_path / "out.jsonl"
    with FakePeer("vllm", fail_from=3) as fake:
        broken = batch(fake, file, out, tmp_path / "s", "--concurrency", "1")
    assert broken.exit_code == 2
    said = " ".join(broken.output.split())
    assert "cannot be reached" in said \
        and f"--resume added (it keeps the finished rows in {out})" in said
    first = rows(out)
    assert [r["line"] for r in first] == list(range(1, 9))  # every line has its row
    finished = [r for r in first if r.get("finish_reason")]
    assert len(finished) == 3 and all(r["status"] == "not_started" for r in first
                                      if not r.get("finish_reason"))
    with FakePeer("vllm") as fake:
        again = batch(fake, file, out, tmp_path / "s", "--resume")
        assert len(fake.bodies) == 5  # only the lines that had not finished
    assert again.exit_code == 0, again.output
    last = rows(out)
    assert all(r.get("finish_reason") for r in last)
    assert [r for r in last if r["line"] in {f["line"] for f in finished}] == finished


def test_unreported_cached_tokens_are_null_and_the_summary_says_so(tmp_path: Path) -> None:
    file = few_shot_file(tmp_path / "lines.jsonl", each=1)
    with FakePeer("vllm", report_cached=False) as fake:
        done = batch(fake, file, tmp_path / "out.jsonl", tmp_path / "s")
    assert done.exit_code == 0, done.output
    assert [r["cache_hit_tokens"] for r in rows(tmp_path / "out.jsonl")] == [None, None]
    assert "reported for 0 of 2 replies" in done.output


def test_session_lines_continue_a_session_kept_here(tmp_path: Path) -> None:
    file = tmp_path / "lines.jsonl"
    file.write_text('{"session": "trip", "system": "Be brief.", "prompt": "Where to?"}\n'
                    '{"session": "trip", "prompt": "And then?"}\n')
    with FakePeer("sglang") as fake:
        done = batch(fake, file, tmp_path / "out.jsonl", tmp_path / "s")
        sent = [b["messages"] for b in fake.bodies]
    assert done.exit_code == 0, done.output
    session = SessionStore(tmp_path / "s").load("trip")
    assert [m["content"] for m in session.messages] == [
        "Where to?", "the sea is wide and deep and blue and old",
        "And then?", "the sea is wide and deep and blue and old"]
    assert session.system == "Be brief." and session.tokens == []
    assert [t.reported_by for t in session.turns] == ["SGLang", "SGLang"]
    assert sent[1] == [{"role": "system", "content": "Be brief."}, *session.messages[:3]]
    assert session.turns[1].hit_tokens == len(" ".join(
        f"<{m['role']}> {m['content']}" for m in sent[0]).split())  # the first turn, whole


def test_pin_system_is_refused_on_an_engine_without_pinning(tmp_path: Path) -> None:
    file = few_shot_file(tmp_path / "lines.jsonl", each=1)
    with FakePeer("vllm") as fake:
        done = batch(fake, file, tmp_path / "out.jsonl", tmp_path / "s", "--pin-system")
    assert done.exit_code == 2 and "no way to pin a prefix" in done.output


def run_chat(fake: FakePeer, root: Path, *lines: str) -> tuple[str, Session]:
    console = Console(file=io.StringIO(), width=100, color_system=None, force_terminal=False)
    client = OpenAIClient(fake.url)
    engine = detect(client)
    store = SessionStore(root)
    backend = PeerBackend(client, engine, store, Ledger.open(root, engine.url, engine.kind))
    session = store.open("trip")
    Chat(backend, session, SamplingParams(max_new_tokens=4), console, Script(*lines)).run()
    client.close()
    return console.file.getvalue(), session


def test_chat_panels_show_the_engines_cached_tokens_and_the_clients_record(tmp_path) -> None:
    with FakePeer("llamacpp") as fake:
        out, session = run_chat(fake, tmp_path, "What is a wave?", "And a tide?", "/pin",
                                "/tree", "/stats")
    found = [(int(a), int(b)) for a, b in re.findall(r"cached (\d+) / (\d+) tok", out)]
    # turn 1's prompt (5 "tokens" for the stand-in) cached when turn 2 sends it again
    assert found[:2] == [(0, 5), (5, 14)]
    assert "as llama.cpp reported" in out and "(its timings)" in out
    assert "TTFT" in out and "(first streamed text, here)" in out
    assert "sent by this client to llama.cpp" in out
    assert "/pin is not available here: llama.cpp keeps its own cache" in out
    assert "this session's turns" in out
    saved = SessionStore(tmp_path).load("trip")
    assert len(saved.turns) == 2 and saved.turns[1].reported_by == "llama.cpp"
    assert saved.turns[1].source == "reported"
    assert ledger_path(tmp_path, fake.url).is_file()
    said = " ".join(out.split())  # quitting says what was saved, and where
    assert f"Saved session trip (2 turns) in {tmp_path} and the record of what this client " \
        f"sent ({ledger_path(tmp_path, fake.url)}); the llama.cpp peer keeps its own cache." \
        in said


def test_chat_moves_work_client_side(tmp_path: Path) -> None:
    with FakePeer("vllm") as fake:
        out, session = run_chat(fake, tmp_path, "What is a wave?", "/retry", "/fork other",
                                "/branches", "/rewind")
        sent = [b["messages"] for b in fake.bodies]
    said = " ".join(out.split())
    assert sent[0] == sent[1]  # the retry resent the same prompt, as prefix for the engine
    assert "Retried: the prompt was 4 of 5 tokens cached (vLLM reported)" in said
    assert "the reply is identical" in said
    assert "Forked trip into other: 2 messages of history" in said
    assert "sessions sharing other's conversation" in said
    assert "Rewound 1 turn(s); 0 left" in said


def test_inspect_and_explain_answer_from_the_clients_record(tmp_path: Path) -> None:
    file = few_shot_file(tmp_path / "lines.jsonl")
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"system": FEW_SHOT.format("the sea"), "prompt": "question 9?"}))
    runner = CliRunner()
    sessions = ["--sessions-dir", str(tmp_path / "s")]
    with FakePeer("sglang") as fake:
        assert batch(fake, file, tmp_path / "out.jsonl", tmp_path / "s").exit_code == 0
        shown = runner.invoke(cli_app, ["inspect", "--connect", fake.url, *sessions], env=WIDE)
        doc = runner.invoke(cli_app, ["inspect", "--connect", fake.url, "--json", *sessions],
                            env=WIDE)
        url = fake.url
    assert shown.exit_code == 0, shown.output
    assert "SGLang 0.4.6.post5 · as it reports" in shown.output and "cache report on" in \
        shown.output
    assert "sent by this client to SGLang · 8 messages" in shown.output
    parsed = json.loads(doc.output)
    assert parsed["engine"]["engine"] == "SGLang" and len(parsed["sent"]["tree"]) == 2
    # the engine has gone: --explain still answers, from the record alone
    why = runner.invoke(cli_app, ["inspect", "--connect", url, "--explain-file", str(probe),
                                  *sessions], env=WIDE)
    assert why.exit_code == 0, why.output
    said = " ".join(why.output.split())
    assert ("this client sent SGLang 3 requests that began as this prompt does: its first 1 "
            "of 2 messages, then 9 of the next one's 11 characters") in said
    assert "what SGLang holds now is its own" in said
    as_json = runner.invoke(cli_app, ["inspect", "--connect", url, "--explain-file",
                                      str(probe), "--json", *sessions], env=WIDE)
    answer = json.loads(as_json.output)
    assert (answer["source"], answer["messages"], answer["requests"]) == (
        "this client's record", 1, 3)


def test_chat_batch_and_inspect_on_an_engine_import_neither_torch_nor_transformers(
        tmp_path: Path) -> None:
    import subprocess
    import sys

    file = few_shot_file(tmp_path / "lines.jsonl", each=1)
    common = ["--connect", "URL", "--sessions-dir", str(tmp_path / "s")]
    commands = [["chat", "-s", "sea", *common], ["batch", str(file), "-o",
                                                 str(tmp_path / "out.jsonl"), *common],
                ["inspect", *common]]
    with FakePeer("llamacpp") as fake:
        for args in commands:
            argv = ["kvchat", *[fake.url if a == "URL" else a for a in args]]
            code = (f"import sys\nfrom kvchat.cli import app\nsys.argv = {argv!r}\n"
                    "try:\n    app()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
                    "print('LOADED', 'torch' in sys.modules, 'transformers' in sys.modules)\n")
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  input="What is a wave?\n/exit\n", timeout=120)
            assert done.returncode == 0, done.stderr
            assert done.stdout.rstrip().endswith("LOADED False False"), (argv, done.stdout)
    assert len(fake.bodies) == 3  # the chat's turn and the batch's two lines


def test_sigterm_stops_an_engine_batch_with_a_row_for_every_line(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    file = tmp_path / "lines.jsonl"
    file.write_text("".join(json.dumps({"prompt": f"question {i}?", "max_tokens": 400}) + "\n"
                            for i in range(12)))
    out = tmp_path / "out.jsonl"
    with FakePeer("vllm", reply=" ".join(["word"] * 400)) as fake:  # 0.8 s a reply
        run = subprocess.Popen([sys.executable, "-m", "kvchat", "batch", str(file), "-o",
                                str(out), "--connect", fake.url, "--concurrency", "2",
                                "--sessions-dir", str(tmp_path / "s")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not fake.bodies:
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.05)
        run.send_signal(signal.SIGTERM)
        stdout, stderr = run.communicate(timeout=60)
    assert run.returncode == 130, stdout + stderr
    found = rows(out)
    assert [r["line"] for r in found] == list(range(1, 13))
    assert all(r.get("status") == "not_started" for r in found if not r.get("finish_reason"))
    assert "--resume" in " ".join(stdout.split())
