"""How long kvchat waits on another server, and what it says when the server misbehaves, against
the raw-socket servers of tests/_bad_servers.py: a server that never answers, one that drips a
byte every 0.2 s, an event stream that never ends, replies that are not JSON, not UTF-8, not a
chat completion, and HTTP 500/503. Every call ends with one sentence naming the URL and what
was wrong (which bound passed, and its value); a batch gives that line its error row and goes
on; SIGTERM and Ctrl-C stop a `--connect` batch at once with a row for every line.

Bounds here are 1-2 s; time is asserted only as a generous "it did not hang" upper bound."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _bad_servers import BadEngine
from rich.console import Console
from test_chat_commands import Script
from typer.testing import CliRunner

from kvchat.chat.peer import PeerBackend
from kvchat.chat.repl import Chat
from kvchat.cli import app as cli_app
from kvchat.client import Client
from kvchat.client.errors import BadReply, ReplyTimeout, ServerError
from kvchat.client.ledger import Ledger
from kvchat.client.openai_http import OpenAIClient, Usage
from kvchat.client.peers import detect
from kvchat.client.replies import lines
from kvchat.config import Bounds, ConfigError, SamplingParams
from kvchat.sessions import SessionStore

WIDE = {"COLUMNS": "200"}
HUNG = 15.0  # far above every bound used here: a call that took this long hung
SMALL = Bounds(connect_s=1, idle_s=1, total_s=1.5)
MESSAGES = "messages"


def ask(text: str) -> dict:
    return {"model": "bad-model", MESSAGES: [{"role": "user", "content": text}],
            "max_tokens": 4}


def timed(call):
    started = time.monotonic()
    try:
        return call(), time.monotonic() - started
    except Exception as exc:  # noqa: BLE001 - the error is what the test reads
        return exc, time.monotonic() - started


# ---- the bounds ----

@pytest.mark.parametrize(("behaviour", "bounds", "bound", "said"), [
    # the overall timer starts before the connection, the idle one once the request is out:
    # 2 s between them, so a loaded machine still sees the idle bound pass first
    ("silent", Bounds(1, 1, 3), "idle", "sent nothing for 1 s (--idle-timeout)"),
    ("silent", Bounds(1, None, 1.5), "total", "was not complete after 1.5 s (--request-timeout)"),
    ("drip", SMALL, "total", "was not complete after 1.5 s (--request-timeout)"),
    ("drip-body", SMALL, "total", "was not complete after 1.5 s (--request-timeout)"),
    ("endless", SMALL, "total", "was not complete after 1.5 s (--request-timeout)"),
])
def test_each_bound_ends_a_streamed_reply_saying_which(behaviour, bounds, bound, said) -> None:
    with BadEngine() as bad, OpenAIClient(bad.url, bounds=bounds) as client:
        error, took = timed(lambda: client.chat(ask(behaviour)).drain())
    assert isinstance(error, ReplyTimeout), error
    assert error.bound == bound and said in str(error) and bad.url in str(error)
    assert took < HUNG


def test_a_server_that_never_accepts_passes_the_connect_bound() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # never accepted: once its queue is full, connections wait for ever
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    queued = []
    for _ in range(3):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(listener.getsockname())
        except BlockingIOError:
            pass
        queued.append(s)
    try:
        with OpenAIClient(url, bounds=Bounds(1, 1, 5)) as client:
            error, took = timed(lambda: client.chat(ask("hi")))
    finally:
        for s in [*queued, listener]:
            s.close()
    assert isinstance(error, ReplyTimeout) and error.bound == "connect", error
    assert f"The server at {url} did not accept the connection within 1 s " \
           "(--connect-timeout)" in str(error)
    assert took < HUNG


def test_detection_is_bounded_too() -> None:
    """A --connect URL that accepts and never answers: the command ends, it does not wait."""
    with BadEngine(answers_gets=False) as bad, OpenAIClient(bad.url, bounds=SMALL) as client:
        error, took = timed(lambda: detect(client))
    assert isinstance(error, ReplyTimeout) and error.bound == "idle"
    assert took < HUNG


def test_a_kvchat_servers_whole_reply_is_under_the_overall_bound() -> None:
    """/generate without streaming sends nothing until it is done: the overall bound, not the
    idle one, says how long it may compute."""
    with BadEngine("kvchat") as bad, Client(bad.url, bounds=Bounds(1, 0.5, 1.5)) as client:
        error, took = timed(lambda: client.generate({"prompt": "gen-silent"}))
        assert isinstance(error, ReplyTimeout) and error.bound == "total", error
        assert "was not complete after 1.5 s (--request-timeout)" in str(error)
        with pytest.raises(ReplyTimeout, match="sent nothing for 0.5 s"):
            client.stream({"prompt": "silent"})  # not even its headers
        stream = client.stream({"prompt": "stall"})
        assert list(stream) == [] and stream.result is None
        assert stream.error is not None and "sent nothing for 0.5 s" in stream.error
    assert took < HUNG


def test_bounds_are_checked_with_the_option_names() -> None:
    with pytest.raises(ConfigError, match="--connect-timeout takes a number of seconds above 0"):
        Bounds(0, 1, 1)
    with pytest.raises(ConfigError, match=r"--idle-timeout .* \(0 turns it off\)"):
        Bounds(1, -1, 1)
    assert Bounds.of_options(10, 0, 0) == Bounds(10, None, None)


# ---- bad replies ----

@pytest.mark.parametrize(("behaviour", "said"), [
    ("sse-garbage", "/v1/chat/completions sent an event that is not JSON"),
    ("sse-no-choices", "/v1/chat/completions has no `choices`: it is not a chat completion"),
    ("sse-not-utf8", "/v1/chat/completions is not UTF-8 text (byte 0xff"),
    ("sse-html", "/v1/chat/completions is not an event stream: it begins \"<html>"),
    ("one-long-line", "/v1/chat/completions sent a line of over 1 MiB without ending it: it "
                      "begins 'data: xxx"),
    ("json-garbage", "/v1/chat/completions is not JSON (Expecting property name"),
    ("json-no-choices", "/v1/chat/completions has no `choices`: it is not a chat completion"),
    ("json-not-utf8", "/v1/chat/completions is not UTF-8 text (byte 0xff"),
    ("http-500", "answered HTTP 500 Internal Server Error: model crashed"),
    ("http-503", "answered HTTP 503 Service Unavailable: overloaded, try later"),
])
def test_a_bad_peer_reply_says_what_was_wrong(behaviour, said) -> None:
    with BadEngine() as bad, OpenAIClient(bad.url, bounds=SMALL) as client:
        error, _ = timed(lambda: client.chat(ask(behaviour)).drain())
    assert isinstance(error, ServerError), error
    assert said in str(error) and bad.url in str(error), str(error)
    assert "ended before it finished" not in str(error)


REPORTED = {"prompt_tokens": 3, "completion_tokens": 2}


@pytest.mark.parametrize(("behaviour", "usage", "body_usage"), [
    ("usage-not-object", Usage(None, None, None, None), None),
    ("details-not-object", Usage(3, 2, None, None), {**REPORTED, "prompt_tokens_details": [1]}),
    ("timings-not-object", Usage(3, 2, None, None), REPORTED),
])
def test_a_wrong_typed_statistic_is_read_as_not_reported(behaviour, usage, body_usage) -> None:
    """`usage`, its `prompt_tokens_details` and llama.cpp's `timings` are optional: one that is
    not a JSON object is read as not reported, and the reply is still good."""
    with BadEngine() as bad, OpenAIClient(bad.url, bounds=SMALL) as client:
        reply = client.chat(ask(behaviour)).drain()
    assert (reply.text, reply.finish_reason, reply.usage) == ("fine reply", "stop", usage)
    assert reply.body["usage"] == body_usage and "timings" not in reply.body


def test_an_event_stream_line_that_never_ends_fails_at_the_cap() -> None:
    """A server streaming bytes without a newline: the line fails at 1 MiB, long before the
    overall bound (the only one it would meet: bytes keep coming)."""
    bounds = Bounds(1, 1, 10)
    with BadEngine() as bad, OpenAIClient(bad.url, bounds=bounds) as client:
        error, took = timed(lambda: client.chat(ask("one-long-line")).drain())
        assert isinstance(error, BadReply), error
        assert f"The reply from {bad.url}/v1/chat/completions sent a line of over 1 MiB " \
               "without ending it" in str(error)
    with BadEngine("kvchat") as bad, Client(bad.url, bounds=bounds) as kvchat:
        stream = kvchat.stream({"prompt": "one-long-line"})
        assert list(stream) == [] and stream.error is not None
        assert "/generate sent a line of over 1 MiB without ending it" in stream.error
    assert took < HUNG


class Chunks:
    """A response that sends its body in these pieces."""

    def __init__(self, *pieces: bytes) -> None:
        self.pieces = pieces

    def iter_bytes(self):
        yield from self.pieces


def test_event_stream_lines_are_read_across_pieces() -> None:
    got = list(lines("u", Chunks(b"data: a\r", b"\ndata: b\n\nda", b"", b"ta: c\r\n",
                                 b"\xc3", b"\xa9\n", b"tail")))
    assert got == ["data: a", "data: b", "", "data: c", "\u00e9", "tail"]
    whole = b"x" * ((1 << 20) - 1)  # 1 MiB with its newline
    assert list(lines("u", Chunks(whole[:10], whole[10:], b"\n"))) == [whole.decode()]
    with pytest.raises(BadReply, match="sent a line of over 1 MiB without ending it"):
        list(lines("u", Chunks(whole, b"yy", b"\n")))


def test_a_whole_json_reply_to_a_streamed_request_is_read() -> None:
    with BadEngine() as bad, OpenAIClient(bad.url, bounds=SMALL) as client:
        reply = client.chat(ask("json-good")).drain()
    assert (reply.text, reply.finish_reason, reply.usage.prompt_tokens) == ("whole reply",
                                                                            "stop", 3)


@pytest.mark.parametrize(("behaviour", "said"), [
    ("gen-garbage", "/generate is not JSON (Expecting value"),
    ("gen-wrong-shape", "/generate has no `text`, `prompt_tokens`"),
    ("gen-not-utf8", "/generate is not UTF-8 text (byte 0xff"),
    ("gen-null-tokens", "/generate has `prompt_tokens` that is not a whole number: it is null"),
    ("gen-text-times", "/generate has `ttft_ms` that is not a number: it is \"fast\""),
    ("http-500", "answered HTTP 500 Internal Server Error: model crashed"),
    ("http-503", "answered HTTP 503 Service Unavailable: overloaded, try later"),
])
def test_a_bad_kvchat_server_reply_says_what_was_wrong(behaviour, said) -> None:
    with BadEngine("kvchat") as bad, Client(bad.url, bounds=SMALL) as client:
        error, _ = timed(lambda: client.generate({"prompt": behaviour}))
        assert isinstance(error, ServerError), error
        assert said in str(error) and bad.url in str(error), str(error)
        stream = client.stream({"prompt": "gen-sse-garbage"})
        assert list(stream) == [] and stream.error is not None
        assert "/generate sent an event that is not JSON" in stream.error


def test_a_generate_reply_is_checked_for_every_field_a_row_is_read_from() -> None:
    from _bad_servers import GENERATE_FIELDS as SENT

    from kvchat.client.http import GENERATE_FIELDS, GENERATE_LATER_FIELDS, generate_reply
    from kvchat.responses import result_fields, result_from_fields

    assert set(GENERATE_FIELDS) | set(GENERATE_LATER_FIELDS) == \
        set(result_fields(result_from_fields(SENT)))
    # a server started by an earlier kvchat sends no replayed_tokens: read as none replayed
    older = {k: v for k, v in SENT.items() if k not in GENERATE_LATER_FIELDS}
    assert result_from_fields(generate_reply("x", older)).replayed_tokens == 0
    with pytest.raises(BadReply, match="replayed_tokens"):
        generate_reply("x", {**SENT, "replayed_tokens": "many"})


# ---- the commands ----

def write_lines(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": p, "prompt": p}) + "\n" for p in prompts))
    return path


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_batch_gives_each_bad_reply_its_error_row_and_goes_on(tmp_path: Path) -> None:
    said = {
        "silent": "sent nothing for 1 s (--idle-timeout)",
        "drip": "was not complete after 2 s (--request-timeout)",
        "endless": "was not complete after 2 s (--request-timeout)",
        "sse-garbage": "sent an event that is not JSON",
        "sse-no-choices": "has no `choices`",
        "sse-not-utf8": "is not UTF-8 text",
        "http-500": "answered HTTP 500 Internal Server Error: model crashed",
        "http-503": "answered HTTP 503 Service Unavailable",
        "json-garbage": "is not JSON",
        "one-long-line": "sent a line of over 1 MiB without ending it",
    }
    unreported = ["usage-not-object", "details-not-object", "timings-not-object"]
    file = write_lines(tmp_path / "lines.jsonl", ["good", *said, *unreported, "good again"])
    out = tmp_path / "out.jsonl"
    with BadEngine() as bad:
        started = time.monotonic()
        done = CliRunner().invoke(cli_app, [
            "batch", str(file), "-o", str(out), "--connect", bad.url, "--sessions-dir",
            str(tmp_path / "s"), "--concurrency", "4", "--connect-timeout", "1",
            "--idle-timeout", "1", "--request-timeout", "2"], env=WIDE)
        took = time.monotonic() - started
    assert done.exit_code == 1, done.output  # some lines failed; the run itself finished
    assert took < 4 * HUNG and "Traceback" not in done.output
    found = {r["id"]: r for r in rows(out)}
    assert [r["line"] for r in rows(out)] == list(range(1, len(said) + len(unreported) + 3))
    assert found["good"]["text"] == "fine reply" and found["good again"]["text"] == "fine reply"
    for behaviour, words in said.items():
        assert words in found[behaviour]["error"] and bad.url in found[behaviour]["error"], \
            found[behaviour]
    for behaviour in unreported:  # a statistic of the wrong type is not reported, not an error
        row = found[behaviour]
        assert "error" not in row and row["text"] == "fine reply", row
        assert row["cache_hit_tokens"] is None and "prefill_ms" not in row


def test_batch_on_a_kvchat_server_gives_each_bad_reply_its_error_row(tmp_path: Path) -> None:
    said = {"gen-silent": "was not complete after 1.5 s (--request-timeout)",
            "gen-garbage": "is not JSON", "gen-wrong-shape": "has no `text`",
            "gen-null-tokens": "has `prompt_tokens` that is not a whole number: it is null",
            "http-503": "answered HTTP 503 Service Unavailable"}
    file = write_lines(tmp_path / "lines.jsonl", ["gen-good", *said])
    out = tmp_path / "out.jsonl"
    with BadEngine("kvchat") as bad:
        done = CliRunner().invoke(cli_app, [
            "batch", str(file), "-o", str(out), "--connect", bad.url, "--sessions-dir",
            str(tmp_path / "s"), "--request-timeout", "1.5"], env=WIDE)
    assert done.exit_code == 1, done.output
    found = {r["id"]: r for r in rows(out)}
    assert found["gen-good"]["text"] == "fine reply"
    for behaviour, words in said.items():
        assert words in found[behaviour]["error"], found[behaviour]


def test_chat_says_which_bound_passed_and_goes_on(tmp_path: Path) -> None:
    console = Console(file=io.StringIO(), width=200, color_system=None, force_terminal=False)
    with BadEngine() as bad, OpenAIClient(bad.url, bounds=SMALL) as client:
        engine = detect(client)
        store = SessionStore(tmp_path)
        backend = PeerBackend(client, engine, store, Ledger.open(tmp_path, bad.url,
                                                                   engine.kind))
        session = store.open("trip")
        Chat(backend, session, SamplingParams(max_new_tokens=4), console,
             Script("silent", "endless", "http-500", "usage-not-object", "good")).run()
    out = console.file.getvalue()
    assert f"The server at {bad.url} sent nothing for 1 s (--idle-timeout)" in out
    assert "was not complete after 1.5 s (--request-timeout)" in out
    assert "The text shown so far is not kept in the session." in out
    assert "answered HTTP 500 Internal Server Error: model crashed" in out
    assert "fine reply" in out
    assert [m["content"] for m in session.messages] == ["usage-not-object", "fine reply",
                                                         "good", "fine reply"]


def test_a_lines_own_error_is_kept_after_another_line_found_the_engine_gone(
        tmp_path: Path) -> None:
    """Only lines this client hung up are "interrupted": a line whose own bound passes after
    another line found the engine gone keeps its error."""
    file = write_lines(tmp_path / "lines.jsonl", ["silent", "hang-up"])
    out = tmp_path / "out.jsonl"
    with BadEngine() as bad:
        done = CliRunner().invoke(cli_app, [
            "batch", str(file), "-o", str(out), "--connect", bad.url, "--sessions-dir",
            str(tmp_path / "s"), "--concurrency", "2", "--idle-timeout", "1"], env=WIDE)
    assert "Traceback" not in done.output, done.output
    found = {r["id"]: r for r in rows(out)}
    assert "sent nothing for 1 s (--idle-timeout)" in found["silent"].get("error", ""), \
        found["silent"]
    assert found["hang-up"]["status"] == "not_started", found["hang-up"]


@pytest.mark.parametrize("kind", ["vllm", "kvchat"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_a_connect_batch_at_once_with_a_row_for_every_line(
        sig, kind, tmp_path: Path) -> None:
    """The engine (or kvchat server) accepts and never answers; the default bounds (minutes)
    are not what ends the run: the first signal hangs up, writes every row and exits 130."""
    file = write_lines(tmp_path / "lines.jsonl", ["silent"] * 6)
    out = tmp_path / "out.jsonl"
    with BadEngine(kind) as bad:
        run = subprocess.Popen([sys.executable, "-m", "kvchat", "batch", str(file), "-o",
                                str(out), "--connect", bad.url, "--concurrency", "2",
                                "--sessions-dir", str(tmp_path / "s")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **WIDE})
        try:
            bad.wait_posts(2)
            time.sleep(0.3)
            sent = time.monotonic()
            run.send_signal(sig)
            stdout, stderr = run.communicate(timeout=HUNG * 2)
        finally:
            if run.poll() is None:
                run.kill()
        took = time.monotonic() - sent
    assert run.returncode == 130, stdout + stderr
    assert took < HUNG
    assert "Traceback" not in stderr + stdout, stderr
    found = rows(out)
    assert [r["line"] for r in found] == list(range(1, 7))
    interrupted = [r for r in found if r.get("finish_reason") == "interrupted"]
    if kind == "vllm":  # the two lines in flight, with the text so far (none)
        assert len(interrupted) == 2 and all(r["text"] == "" for r in interrupted)
    assert all(r["status"] == "not_started" for r in found if r not in interrupted)
    assert "--resume" in " ".join(stdout.split())
