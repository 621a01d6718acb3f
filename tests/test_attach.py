"""Attached commands, over loopback against a real `kvchat serve --detach` process on the tiny
model: the lock file names the server, chat-like session turns and batches share the cache,
inspect reads the live tree, a killed server loses no batch line, `kvchat stop` saves."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from kvchat.client import Client, ServerError
from kvchat.session_lock import lock_holder

SYSTEM = "You are a terse assistant who answers in one short sentence about the sea."
TIMEOUT_S = 120


class Running(NamedTuple):
    sessions: Path
    url: str
    token: str
    pid: int


def kvchat(*args: str, timeout: float = TIMEOUT_S, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvchat", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def start(model: Path, sessions: Path) -> Running:
    done = kvchat("serve", "--detach", "--model", str(model), "--device", "cpu", "--port", "0",
                  "--block-size", "4", "--cache-mb", "4", "--sessions-dir", str(sessions))
    assert done.returncode == 0, done.stderr + done.stdout
    holder = lock_holder(sessions)
    assert holder is not None and holder.url and holder.token
    assert holder.url in done.stdout
    said = " ".join(done.stdout.split())
    assert f"`kvchat token --sessions-dir {sessions}` prints it" in said  # where the token is
    return Running(sessions, holder.url, holder.token, holder.pid)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    sessions = tmp_path_factory.mktemp("attach") / "sessions"
    umask = os.umask(0o022)  # the usual umask: every folder kvchat makes is 0700 anyway
    try:
        running = start(tiny_model_dir, sessions)
    finally:
        os.umask(umask)
    try:
        yield running
    finally:
        if lock_holder(sessions) is not None:
            kvchat("stop", "--sessions-dir", str(sessions))


def write_lines(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_lock_file_names_the_server_and_the_token_is_required(server: Running) -> None:
    lock = server.sessions / ".lock"
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    record = json.loads(lock.read_text())  # plain JSON, readable by any tool
    assert record["token"] == server.token and record["url"] == server.url
    assert record["pid"] == server.pid and record["what"] == "kvchat serve"
    printed = kvchat("token", "--sessions-dir", str(server.sessions))
    assert printed.returncode == 0 and printed.stdout.strip() == server.token
    log = server.sessions / "serve.log"
    assert "Access token: generated; not written to this log" in log.read_text()
    assert server.token not in log.read_text()
    said = " ".join(log.read_text().split())
    assert f"kvchat serve listening on {server.url} " in said  # where it answers, said once
    assert f"OpenAI base URL {server.url}/v1" in said
    assert "ready in" in said and "import" in said and "load" in said  # what the start took
    for folder in (server.sessions, server.sessions / "cache", server.sessions / "cache" / "store"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder  # before any save
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    assert httpx.get(f"{server.url}/cache/stats").status_code == 401
    with Client(server.url, "wrong-token") as client, pytest.raises(ServerError) as err:
        client.cache_stats()
    assert err.value.status == 401 and "token" in str(err.value)
    with Client(server.url, server.token) as client:
        assert "pool" in client.cache_stats()


def test_a_standalone_run_is_refused_while_the_server_holds_the_dir(server: Running,
                                                                    tmp_path: Path) -> None:
    lines = write_lines(tmp_path / "in.jsonl", [{"prompt": "hi", "max_tokens": 2}])
    done = kvchat("batch", str(lines), "--standalone", "--sessions-dir", str(server.sessions))
    assert done.returncode == 2
    assert f"pid {server.pid} (kvchat serve" in " ".join(done.stderr.split())


def test_batch_and_session_turns_share_hits_both_ways(server: Running, tmp_path: Path) -> None:
    with Client(server.url, server.token) as client:
        # a chat turn caches its system prompt; an attached batch then hits it
        first = client.generate({"prompt": "Hello there.", "system": SYSTEM, "session": "sea",
                                 "create_session": True, "max_tokens": 3})
        assert first["session"] == "sea"
        out = tmp_path / "out.jsonl"
        lines = write_lines(tmp_path / "in.jsonl", [
            {"id": "a", "system": SYSTEM, "prompt": "What is a wave?", "max_tokens": 3},
            {"id": "b", "prompt": "A brand new question about rivers?", "system": "Be brief.",
             "max_tokens": 3},
        ])
        done = kvchat("batch", str(lines), "-o", str(out), "--cache-mb", "64",
                      "--sessions-dir", str(server.sessions))
        assert done.returncode == 0, done.stderr
        assert "attached to" in done.stdout
        assert "--cache-mb ignored" in done.stderr  # the server keeps its own settings
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert [r["line"] for r in rows] == [1, 2]
        assert rows[0]["cache_hit_tokens"] >= 16  # the system prompt the turn cached
        assert {"input_digest", "ttft_ms", "finish_reason", "text"} <= set(rows[0])
        # and the reverse: a session turn hits what the batch cached
        turn = client.generate({"prompt": "A brand new question about rivers?",
                                "system": "Be brief.", "session": "river",
                                "create_session": True, "max_tokens": 3})
        assert turn["cache_hit_tokens"] >= 16
        names = [s["name"] for s in client.sessions()]
        assert {"sea", "river"} <= set(names)
        session = client.session("sea")
        assert session is not None and session["system"] == SYSTEM and len(session["turns"]) == 1


def test_an_attached_batch_refuses_the_values_a_standalone_one_does(server: Running,
                                                                   tmp_path: Path) -> None:
    """`max_tokens: 0` on a line sent to a server is that line's error, as in a standalone run
    and on /generate (it used to run with the default length)."""
    out = tmp_path / "out.jsonl"
    lines = write_lines(tmp_path / "in.jsonl", [
        {"id": "zero", "prompt": "Hi", "max_tokens": 0},
        {"id": "cold", "prompt": "Hi", "temperature": 1e-9},
        {"id": "ok", "prompt": "Hi", "max_tokens": 2},
    ])
    done = kvchat("batch", str(lines), "-o", str(out), "--sessions-dir", str(server.sessions))
    assert "attached to" in done.stdout, done.stderr
    rows = {r["line"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "max_tokens" in rows[1]["error"] and "text" not in rows[1]
    assert "temperature" in rows[2]["error"] and "text" not in rows[2]
    assert rows[3].get("error") is None and rows[3]["completion_tokens"] <= 2


def test_an_attached_batch_sends_twice_what_the_server_decodes_at_once(server: Running) -> None:
    """A reply that is not streamed says nothing until it is done, so a line's wait in the
    server's queue counts toward --request-timeout: the run keeps that queue short."""
    from kvchat.batch.attached import MAX_IN_FLIGHT, in_flight

    with Client(server.url, server.token) as client:
        health = client.health()
    assert health["batch_size"] >= 1
    assert in_flight(health) == min(MAX_IN_FLIGHT, 2 * health["batch_size"])
    assert in_flight({}) == in_flight({"batch_size": "8"}) == MAX_IN_FLIGHT


def test_attached_inspect_reads_the_live_tree_without_torch(server: Running) -> None:
    argv = ["kvchat", "inspect", "--json", "--sessions-dir", str(server.sessions)]
    code = (f"import sys\nfrom kvchat.cli import app\nsys.argv = {argv!r}\n"
            "try:\n    app()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('LOADED', 'torch' in sys.modules, 'transformers' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    doc_line, loaded = done.stdout.strip().splitlines()
    assert loaded == "LOADED False False"
    doc = json.loads(doc_line)
    with Client(server.url, server.token) as client:
        assert doc["tree"] == client.cache_tree()["tree"]
    text = kvchat("inspect", "--sessions-dir", str(server.sessions))
    assert text.returncode == 0 and "live cache of the server" in " ".join(text.stdout.split())


def test_closing_a_stream_cancels_the_request_on_the_server(server: Running) -> None:
    with Client(server.url, server.token) as client:
        before = client.cache_stats()["server"]["cancelled"]
        reply = client.stream({"prompt": "Count to a thousand, slowly.", "max_tokens": 2000})
        for _ in reply:
            break  # one delta, then hang up
        reply.close()
        deadline = time.monotonic() + 30
        while client.cache_stats()["server"]["cancelled"] <= before:
            assert time.monotonic() < deadline, "the server did not cancel the request"
            time.sleep(0.05)


def test_a_killed_server_loses_no_line_and_resume_finishes(tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    sessions = tmp_path / "sessions"
    first = start(tiny_model_dir, sessions)
    lines = write_lines(tmp_path / "in.jsonl", [
        {"prompt": f"Question number {i}: tell me a long story.", "max_tokens": 200}
        for i in range(12)])
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "kvchat", "batch", str(lines), "-o", str(out),
                             "--sessions-dir", str(sessions)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + TIMEOUT_S
    while not (out.exists() and out.read_text().strip()):  # the first rows are in
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(first.pid, signal.SIGKILL)
    output, _ = proc.communicate(timeout=TIMEOUT_S)
    said = " ".join(output.split())
    assert proc.returncode == 2, output
    assert "cannot be reached" in said and "--resume" in said
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["line"] for r in rows) == list(range(1, 13))  # every line has its row
    finished = [r for r in rows if "error" not in r]
    assert len(finished) < 12
    second = start(tiny_model_dir, sessions)
    try:
        done = kvchat("batch", str(lines), "-o", str(out), "--resume", "--sessions-dir",
                      str(sessions), timeout=3 * TIMEOUT_S)  # a busy CPU: minutes
        assert done.returncode == 0, done.stdout + done.stderr
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert [r["line"] for r in rows] == list(range(1, 13))
        assert all("error" not in r and r["finish_reason"] in ("stop", "length") for r in rows)
    finally:
        stopped = kvchat("stop", "--sessions-dir", str(sessions))
    assert stopped.returncode == 0, stopped.stderr
    assert f"pid {second.pid}" in stopped.stdout
    assert lock_holder(sessions) is None
    assert second.token not in (sessions / ".lock").read_text()  # withdrawn on the way out
    assert (sessions / "cache" / "index.json").exists()  # the snapshot was saved on stop
    assert stat.S_IMODE((sessions / "serve.log").stat().st_mode) == 0o600


def test_an_attached_chat_runs_turns_and_commands_without_torch(server: Running) -> None:
    argv = ["kvchat", "chat", "--session", "piped", "--max-tokens", "3", "--panels", "compact",
            "--sessions-dir", str(server.sessions)]
    code = (f"import sys\nfrom kvchat.cli import app\nsys.argv = {argv!r}\n"
            "try:\n    app()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('LOADED', 'torch' in sys.modules, 'transformers' in sys.modules)\n")
    script = "Hello there.\n/system Be brief.\nHello again.\n/stats\n/tree\n/sessions\n" \
             "/clear-cache\n/pin\n/pins\n/unpin\n/save\n/exit\n"
    done = subprocess.run([sys.executable, "-c", code], input=script, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.replace("│", " ").split())
    assert out.endswith("LOADED False False")
    assert f"server {server.url}" in out and "turn 1 ·" in out and "turn 2 ·" in out
    assert "radix tree ·" in out and "piped" in out
    assert "/clear-cache is not available here" in out
    assert "Pinned system prompt:" in out and "pins · " in out
    assert "Unpinned system prompt" in out
    assert "Saved session piped and the cache snapshot" in out
    assert f"Saved session piped (2 turns) on the kvchat server at {server.url}, which keeps " \
        "the cache and saves its snapshot when it stops." in out
    with Client(server.url, server.token) as client:
        session = client.session("piped")
    assert session is not None and session["system"] == "Be brief."
    assert len(session["turns"]) == 2


def test_hanging_up_an_attached_reply_stops_it_on_the_server(server: Running) -> None:
    from kvchat.chat.backend import TurnDone
    from kvchat.chat.server import ServerBackend
    from kvchat.config import SamplingParams

    with Client(server.url, server.token) as client:
        backend = ServerBackend(client, "test")
        session = backend.sessions.open("hang-up")
        before = client.cache_stats()["server"]["cancelled"]
        reply = backend.start(session, "Count to a thousand.", SamplingParams(max_new_tokens=2000))
        for _ in reply:
            break  # what Ctrl-C does in the REPL: close the stream
        reply.close()
        done = reply.finish()
        assert isinstance(done, TurnDone)
        assert done.turn.finish_reason == "interrupted" and done.turn.completion_tokens < 2000
        assert session.turns == [done.turn]  # the server recorded the stopped turn
        assert client.cache_stats()["server"]["cancelled"] == before + 1


@pytest.mark.parametrize("args, torch_free", [
    (["--help"], True),
    (["inspect", "--sessions-dir", "{tmp}/none"], True),
    (["token", "--sessions-dir", "{tmp}/none"], True),
    (["models", "--model", "{model}", "--device", "cpu"], False),
], ids=["help", "inspect", "token", "models"])
def test_light_commands_do_not_import_modeling_code(args: list[str], torch_free: bool,
                                                    tiny_model_dir: Path, tmp_path: Path) -> None:
    argv = ["kvchat", *(a.format(tmp=tmp_path, model=tiny_model_dir) for a in args)]
    code = (f"import sys\nfrom kvchat.cli import app\nsys.argv = {argv!r}\n"
            "try:\n    app()\nexcept SystemExit:\n    pass\n"
            "print('LOADED', 'torch' in sys.modules, 'transformers' in sys.modules,"
            " 'transformers.modeling_utils' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    loaded = done.stdout.strip().splitlines()[-1].split()
    assert loaded[0] == "LOADED" and loaded[3] == "False", done.stdout + done.stderr
    if torch_free:
        assert loaded[1:3] == ["False", "False"]


def test_attached_explain_answers_from_the_live_tree(server: Running, tmp_path: Path) -> None:
    """--explain on a kvchat server (the one holding the dir, or --connect) asks its live
    cache, not the snapshot it last saved."""
    with Client(server.url, server.token) as client:
        client.generate({"prompt": "Explain the tides.", "system": SYSTEM, "max_tokens": 3})
    held = kvchat("inspect", "--explain", "Explain the tides.", "--system", SYSTEM, "--json",
                  "--sessions-dir", str(server.sessions))
    assert held.returncode == 0, held.stderr
    assert json.loads(held.stdout)["miss_reason"] == "hit"
    text = kvchat("inspect", "--explain", "Explain the waves.", "--system", SYSTEM,
                  "--connect", server.url, "--token", server.token,
                  "--sessions-dir", str(tmp_path))
    said = " ".join(text.stdout.split())
    assert text.returncode == 0, text.stderr
    assert "live cache of the server at" in said and "diverged at token" in said


def test_connect_takes_the_token_from_the_environment(server: Running, tmp_path: Path) -> None:
    args = ("inspect", "--json", "--connect", server.url, "--sessions-dir", str(tmp_path))
    refused = kvchat(*args, env={"KVCHAT_TOKEN": ""})
    assert refused.returncode == 2 and "token" in " ".join(refused.stderr.split())
    done = kvchat(*args, env={"KVCHAT_TOKEN": server.token})
    assert done.returncode == 0, done.stderr
    assert "tree" in json.loads(done.stdout)
    done = kvchat("inspect", "--json", "--connect", server.url, "--standalone")
    assert done.returncode == 2 and "give one of them" in " ".join(done.stderr.split())


def test_ctrl_c_in_an_attached_chat_stops_the_reply_on_the_server(server: Running) -> None:
    pexpect = pytest.importorskip("pexpect")
    env = dict(os.environ, TERM="dumb")
    child = pexpect.spawn(sys.executable, ["-m", "kvchat", "chat", "--session", "tty",
                                           "--max-tokens", "1500", "--panels", "compact",
                                           "--sessions-dir", str(server.sessions)],
                          env=env, encoding="utf-8", timeout=TIMEOUT_S, dimensions=(24, 100))
    with Client(server.url, server.token) as client:
        before = client.cache_stats()["server"]["cancelled"]
        try:
            child.expect_exact("tty> ")
            child.sendline("Tell me a story.")
            child.expect_exact("assistant> ")
            child.expect(r"\S")  # the reply has started streaming
            child.sendintr()
            child.expect_exact("tty> ")
            assert "[stopped]" in child.before
            child.sendline("/exit")
            child.expect(pexpect.EOF)
        finally:
            child.close(force=True)
        assert client.cache_stats()["server"]["cancelled"] == before + 1
        session = client.session("tty")
    assert session is not None
    [turn] = session["turns"]
    assert turn["finish_reason"] == "interrupted" and turn["completion_tokens"] < 1500


def test_a_server_killed_mid_reply_ends_the_chat_with_one_clear_message(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    sessions = tmp_path / "sessions"
    running = start(tiny_model_dir, sessions)
    chat = subprocess.Popen([sys.executable, "-m", "kvchat", "chat", "--session", "k",
                             "--max-tokens", "1500", "--panels", "off", "--sessions-dir",
                             str(sessions)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert chat.stdin is not None and chat.stdout is not None
    chat.stdin.write(b"Tell me a story.\n")
    chat.stdin.flush()
    seen, deadline = b"", time.monotonic() + TIMEOUT_S
    while b"assistant> " not in seen or len(seen.split(b"assistant> ", 1)[1]) < 4:
        assert chat.poll() is None and time.monotonic() < deadline, seen
        seen += os.read(chat.stdout.fileno(), 256)  # the reply is streaming
    os.kill(running.pid, signal.SIGKILL)
    _, err = chat.communicate(timeout=TIMEOUT_S)
    said = " ".join(err.decode().split())
    assert chat.returncode == 2, said
    assert "went away during the reply" in said
    assert f"Its process (pid {running.pid}) has exited: it was stopped or killed" in said
    assert "The chat ends here" in said and "kvchat chat --session k" in said
    assert "goes on; kvchat tries again" not in said and "Traceback" not in said


def test_a_lock_naming_a_live_server_that_does_not_answer_says_it_is_running(
    tmp_path: Path,
) -> None:
    import socket

    from typer.testing import CliRunner

    from kvchat.cli import app
    from kvchat.session_lock import sessions_lock

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens here
    root = tmp_path / "sessions"
    with sessions_lock(root, "kvchat serve") as lock:  # held by this (live) process
        lock.publish(closed, "token")
        result = CliRunner().invoke(app, ["inspect", "--sessions-dir", str(root)])
    said = " ".join(result.output.split())
    assert result.exit_code == 2, said
    assert f"Its process (pid {os.getpid()}) is still running" in said
    assert "stopped or killed" not in said
