"""kvchat's front ends on a real third-party engine: llama.cpp's llama-server (built from the
llama-cpp-python sdist by scripts/llama_server.py) on the embedded SmolLM2 GGUF. The chat REPL
in a terminal shows the server's cached tokens; a shared-prefix batch in cache-aware order gets
a higher cached fraction than the same file in input order (both from cached_tokens); a batch
whose server is killed midway loses no row and --resume finishes it; inspect --explain answers
from this client's record; a batch file and a session move unchanged between --standalone, a
kvchat server and llama-server. Skipped, saying why, where llama-server is not built."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _llama_server import REQUIRED, LlamaServer, unavailable

from kvchat.sessions import SessionStore

WHY_NOT = unavailable()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(WHY_NOT is not None and not REQUIRED, reason=str(WHY_NOT))]
pexpect = pytest.importorskip("pexpect")

KVCHAT = Path(sys.executable).parent / "kvchat"
TIMEOUT_S = 300
# --cache-ram 0: no host-RAM prompt cache, so what a slot holds is all llama-server reuses (with
# it, llama-server restores earlier prompts into any slot; see the README's figures)
SLOT_ONLY = ("--cache-ram", "0")
SHOTS = "".join(f"Q: What is fact {i} about {{topic}}?\nA: Fact {i} is that {{topic}} are old "
                "and wide.\n" for i in range(4))


@pytest.fixture(scope="session", autouse=True)
def llama_server_built() -> None:
    """In CI (KVCHAT_REQUIRE_LLAMA_SERVER=1) a missing server fails instead of skipping."""
    if WHY_NOT is not None:
        pytest.fail(f"{WHY_NOT} (KVCHAT_REQUIRE_LLAMA_SERVER=1)")


@pytest.fixture
def llama(embedded_gguf: Path, tmp_path: Path) -> Iterator[LlamaServer]:
    with LlamaServer(embedded_gguf, tmp_path / "llama-server.log", extra=SLOT_ONLY) as server:
        yield server


def kvchat(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "kvchat", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def few_shot(topics: tuple[str, ...], each: int) -> list[dict]:
    """`each` questions per topic, interleaved (A1 B1 C1 A2 ...), each topic's system prompt
    a few-shot block of ~100 tokens that its questions share."""
    return [{"id": f"{t}-{q}", "max_tokens": 4, "prompt": f"Q: What is fact {q + 5} about {t}?",
             "system": f"You answer questions about {t}.\n" + SHOTS.format(topic=t)}
            for q in range(each) for t in topics]


def flat(text: str) -> str:
    """Terminal output as one line of words: panel borders and line breaks gone."""
    return " ".join(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|[│╭╮╰╯─]", " ", text).split())


def cached_share(found: list[dict]) -> float:
    return sum(r["cache_hit_tokens"] for r in found) / sum(r["prompt_tokens"] for r in found)


def test_chat_panels_show_the_servers_cached_tokens(llama: LlamaServer, tmp_path: Path) -> None:
    env = dict(os.environ, TERM="dumb")
    child = pexpect.spawn(str(KVCHAT), ["chat", "--connect", llama.url, "--sessions-dir",
                                        str(tmp_path / "s"), "-s", "sea", "--max-tokens", "12"],
                          env=env, encoding="utf-8", timeout=TIMEOUT_S, dimensions=(40, 120))
    try:
        child.expect_exact("sea> ")
        banner = flat(child.before)
        assert "engine llama.cpp b1-" in banner and "(from /v1/models, /health, /props)" in \
            banner
        outputs = []
        for text in ("What is a wave?", "And a tide?"):
            child.sendline(text)
            child.expect_exact("sea> ")
            outputs.append(flat(child.before))
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    found = [re.search(r"cached (\d+) / (\d+) tok", out) for out in outputs]
    assert all(found), outputs
    first, second = [(int(m.group(1)), int(m.group(2))) for m in found if m]
    assert second[0] >= first[1] - 1  # turn 1's prompt, as llama-server reported it cached
    assert "turn 2 · llama.cpp's cache" in outputs[1] and "as llama.cpp reported" in outputs[1]
    assert "sent by this client to llama.cpp" in outputs[1]
    session = SessionStore(tmp_path / "s").load("sea")
    assert [t.reported_by for t in session.turns] == ["llama.cpp", "llama.cpp"]
    assert session.turns[1].hit_tokens == second[0]


def test_cache_aware_order_gets_more_cached_than_input_order(embedded_gguf: Path,
                                                             tmp_path: Path) -> None:
    file = write_lines(tmp_path / "few-shot.jsonl",
                       few_shot(("rivers", "deserts", "forests", "glaciers"), 3))
    shares, summaries = {}, {}
    for order in ("input", "cache-aware"):  # each on a fresh server: a cold cache
        with LlamaServer(embedded_gguf, tmp_path / f"{order}.log", extra=SLOT_ONLY) as server:
            out = tmp_path / f"{order}.jsonl"
            done = kvchat("batch", str(file), "-o", str(out), "--connect", server.url,
                          "--order", order, "--sessions-dir", str(tmp_path / order))
        assert done.returncode == 0, done.stderr + done.stdout
        found = rows(out)
        assert len(found) == 12 and all(r["engine"] == "llama.cpp" for r in found)
        shares[order], summaries[order] = cached_share(found), " ".join(done.stdout.split())
    assert shares["cache-aware"] > shares["input"] + 0.2, shares
    assert "cache-aware: 4 shared-prefix group(s) of 12 lines" in summaries["cache-aware"]
    hits = sum(r["cache_hit_tokens"] for r in rows(tmp_path / "cache-aware.jsonl"))
    assert f"hit tokens {hits:,}" in summaries["cache-aware"]  # the summary's, from the rows


def test_a_killed_server_loses_no_row_and_resume_finishes(embedded_gguf: Path,
                                                           tmp_path: Path) -> None:
    file = write_lines(tmp_path / "lines.jsonl",
                       [{"id": f"q{i}", "prompt": f"Count from {i} to {i + 30}.",
                         "max_tokens": 24} for i in range(8)])
    out = tmp_path / "out.jsonl"
    first = LlamaServer(embedded_gguf, tmp_path / "first.log", parallel=1).start()
    try:
        run = subprocess.Popen([sys.executable, "-m", "kvchat", "batch", str(file), "-o",
                                str(out), "--connect", first.url, "--concurrency", "1",
                                "--sessions-dir", str(tmp_path / "s")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + TIMEOUT_S
        while not out.exists() or len(out.read_text().splitlines()) < 2:
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.05)
        first.kill()
        stdout, stderr = run.communicate(timeout=TIMEOUT_S)
    finally:
        first.stop()
    said = " ".join((stdout + stderr).split())
    assert run.returncode == 2, said
    assert "cannot be reached" in said \
        and f"--resume added (it keeps the finished rows in {out})" in said
    before = rows(out)
    assert [r["line"] for r in before] == list(range(1, 9))  # every line has its row
    finished = [r for r in before if r.get("finish_reason")]
    assert 2 <= len(finished) < 8
    with LlamaServer(embedded_gguf, tmp_path / "second.log", parallel=1) as second:
        again = kvchat("batch", str(file), "-o", str(out), "--connect", second.url, "--resume",
                       "--sessions-dir", str(tmp_path / "s"))
    assert again.returncode == 0, again.stderr
    after = rows(out)
    assert all(r.get("finish_reason") in ("stop", "length") for r in after)
    assert [r for r in after if r["line"] in {f["line"] for f in finished}] == finished


def test_explain_answers_from_what_this_client_sent(llama: LlamaServer, tmp_path: Path) -> None:
    lines = few_shot(("rivers",), 2)
    file = write_lines(tmp_path / "lines.jsonl", lines)
    sessions = ["--sessions-dir", str(tmp_path / "s")]
    assert kvchat("batch", str(file), "-o", str(tmp_path / "out.jsonl"), "--connect",
                  llama.url, *sessions).returncode == 0
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({**lines[0], "prompt": "Q: What is fact 99 about rivers?"}))
    why = kvchat("inspect", "--connect", llama.url, "--explain-file", str(probe), "--json",
                 *sessions)
    assert why.returncode == 0, why.stderr
    doc = json.loads(why.stdout)
    assert (doc["source"], doc["engine"], doc["messages"], doc["requests"]) == (
        "this client's record", "llama.cpp", 1, 2)
    assert doc["report"]["cached_tokens"] > 0  # the second line hit its group's prefix
    text = kvchat("inspect", "--connect", llama.url, *sessions)
    assert "sent by this client to llama.cpp · 3 messages" in " ".join(text.stdout.split())


def test_a_batch_file_and_a_session_move_between_engines(embedded_gguf: Path, tmp_path: Path,
                                                         use_embedded_cache: Path) -> None:
    """The same file on llama-server, --standalone and a kvchat server; its session line
    extends one session through all three, and a chat on llama-server resumes it."""
    file = write_lines(tmp_path / "lines.jsonl", [
        {"id": "plain", "prompt": "What is a wave?", "max_tokens": 6},
        {"id": "turn", "session": "trip", "system": "You are terse.",
         "prompt": "Name one more sea.", "max_tokens": 6}])
    sessions = tmp_path / "s"
    with LlamaServer(embedded_gguf, tmp_path / "llama.log") as llama:
        runs = [("llama.cpp", ["--connect", llama.url])]
        runs += [("", ["--standalone"]), ("", [])]  # [] : attached to the kvchat server
        for n, (engine, how) in enumerate(runs):
            if not how:
                up = kvchat("serve", "--detach", "--port", "0", "--sessions-dir", str(sessions))
                assert up.returncode == 0, up.stderr
            out = tmp_path / f"out-{n}.jsonl"
            try:
                done = kvchat("batch", str(file), "-o", str(out), *how, "--sessions-dir",
                              str(sessions))
            finally:
                if not how:
                    assert kvchat("stop", "--sessions-dir", str(sessions)).returncode == 0
            assert done.returncode == 0, done.stderr + done.stdout
            found = rows(out)
            assert [r["id"] for r in found] == ["plain", "turn"]
            assert all(r["finish_reason"] in ("stop", "length") and r["text"] for r in found)
            assert found[0].get("engine", "") == engine
        trip = SessionStore(sessions).load("trip")
        assert [t.reported_by for t in trip.turns] == ["llama.cpp", "", ""]
        assert len(trip.messages) == 6 and trip.system == "You are terse."
        env = dict(os.environ, TERM="dumb")
        child = pexpect.spawn(str(KVCHAT), ["chat", "--connect", llama.url, "-s", "trip",
                                            "--sessions-dir", str(sessions), "--max-tokens",
                                            "6"], env=env, encoding="utf-8",
                              timeout=TIMEOUT_S, dimensions=(40, 120))
        try:
            child.expect_exact("trip> ")
            assert "session trip: resumed, 3 turns" in flat(child.before)
            child.sendline("And one more?")
            child.expect_exact("trip> ")
            assert "turn 4 · llama.cpp's cache" in flat(child.before)
            child.sendline("/exit")
            child.expect(pexpect.EOF)
        finally:
            child.close(force=True)
    trip = SessionStore(sessions).load("trip")
    assert len(trip.turns) == 4 and len(trip.messages) == 8
