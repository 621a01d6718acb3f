"""Telling engines apart and reading their replies (`kvchat.client.peers`, `openai_http`), on the
response shapes of llama.cpp (recorded from llama-server), vLLM and SGLang (written from their
documentation; neither can run on this machine), served over loopback by tests/_fake_peer.py;
and the one-paragraph errors for a URL that is not one."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from _fake_peer import FakePeer
from typer.testing import CliRunner

from kvchat.cli import app as cli_app
from kvchat.client.http import ServerError, ServerGone
from kvchat.client.openai_http import OpenAIClient
from kvchat.client.peers import LLAMA_CPP, SGLANG, VLLM, NotOpenAICompatible, detect

WIDE = {"COLUMNS": "200"}


@pytest.mark.parametrize(("kind", "name", "model", "facts", "found_by"), [
    ("llamacpp", f"{LLAMA_CPP} b1-0c1e570", "SmolLM2-135M-Instruct.Q4_1.gguf",
     (("slots", "2"), ("context per slot", "8,192")), ("/v1/models", "/health", "/props")),
    ("vllm", f"{VLLM} 0.9.2", "Qwen/Qwen2.5-0.5B-Instruct", (("max model len", "32,768"),),
     ("/v1/models", "/version")),
    ("sglang", f"{SGLANG} 0.4.6.post5", "qwen/qwen2.5-0.5b-instruct",
     (("cache report", "on"), ("page size", "1")), ("/v1/models", "/get_server_info")),
])
def test_each_engine_is_told_from_its_own_api(kind, name, model, facts, found_by) -> None:
    with FakePeer(kind) as fake, OpenAIClient(fake.url + "/v1") as client:
        engine = detect(client)
    assert (engine.name(), engine.model, engine.facts, engine.found_by) == (
        name, model, facts, found_by)
    assert engine.url == fake.url  # "/v1" or not, the same server
    assert engine.per_slot_cache == (kind == "llamacpp")
    assert engine.slots == (2 if kind == "llamacpp" else None)


@pytest.mark.parametrize("kind", ["llamacpp", "vllm", "sglang"])
def test_a_streamed_reply_is_read_as_each_engine_reports_it(kind) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is a wave?"}]
    with FakePeer(kind) as fake, OpenAIClient(fake.url) as client:
        first = client.chat({"messages": messages, "max_tokens": 3})
        texts = list(first)
        again = client.chat({"messages": messages, "max_tokens": 3}).drain()
        assert fake.bodies[0]["stream"] is True
        assert fake.bodies[0]["stream_options"] == {"include_usage": True}
    assert "".join(texts) == "the sea is" and first.prefilled.is_set()
    reply = first.result
    assert reply is not None and reply.finish_reason == "length"
    n = len("<system> You are terse. <user> What is a wave?".split())
    assert reply.usage[:3] == (n, 3, 0) and again.usage[:3] == (n, 3, n - 1)
    assert (again.usage.prefill_ms is not None) == (kind == "llamacpp")  # llama.cpp's timings
    assert again.ttft_ms is not None and again.total_ms >= again.ttft_ms
    assert again.body["usage"]["prompt_tokens_details"] == {"cached_tokens": n - 1}


def test_an_engine_that_does_not_report_cached_tokens_is_not_said_to_cache_nothing() -> None:
    with FakePeer("vllm", report_cached=False) as fake, OpenAIClient(fake.url) as client:
        reply = client.chat({"messages": [{"role": "user", "content": "hi"}]}).drain()
    assert reply.usage.prompt_tokens == 2 and reply.usage.cached_tokens is None


class _NotOpenAI(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = b"<html>a web page</html>"
        self.send_response(404 if self.path == "/v1/models" else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def web_page() -> str:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotOpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_urls_that_are_no_engine_raise_what_went_wrong(web_page) -> None:
    with OpenAIClient(web_page) as client, pytest.raises(NotOpenAICompatible,
                                                         match="not an OpenAI-compatible"):
        detect(client)
    with OpenAIClient(f"http://127.0.0.1:{free_port()}") as client, \
            pytest.raises(ServerGone, match="cannot be reached"):
        detect(client)
    with FakePeer("vllm", api_key="sk-right") as fake:
        with OpenAIClient(fake.url, "sk-wrong") as client, pytest.raises(ServerError) as err:
            detect(client)
        assert err.value.status == 401 and "--api-key or $OPENAI_API_KEY" in str(err.value)
        with OpenAIClient(fake.url, "sk-right") as client:
            assert detect(client).kind == VLLM


@pytest.mark.parametrize("command", [["chat"], ["batch", "LINES"], ["inspect"]])
def test_the_commands_say_so_in_one_paragraph_and_exit_2(command, web_page, tmp_path: Path,
                                                         monkeypatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    lines = tmp_path / "lines.jsonl"
    lines.write_text('{"prompt": "hi"}\n')
    args = [str(lines) if a == "LINES" else a for a in command]
    runner = CliRunner()
    sessions = ["--sessions-dir", str(tmp_path / "s")]
    gone = runner.invoke(cli_app, [*args, "--connect", f"http://127.0.0.1:{free_port()}",
                                       *sessions], env=WIDE)
    assert gone.exit_code == 2 and "cannot be reached" in gone.output
    assert "Traceback" not in gone.output
    page = runner.invoke(cli_app, [*args, "--connect", web_page, *sessions], env=WIDE)
    assert page.exit_code == 2 and "not an OpenAI-compatible server" in page.output
    with FakePeer("llamacpp", api_key="sk-right") as fake:
        refused = runner.invoke(cli_app, [*args, "--connect", fake.url, *sessions],
                                env=WIDE)
        assert refused.exit_code == 2 and "refused the credentials (HTTP 401" in refused.output
        assert "Traceback" not in refused.output
        env = {**WIDE, "OPENAI_API_KEY": "sk-right"}
        ok = runner.invoke(cli_app, ["inspect", "--connect", fake.url, *sessions], env=env)
        assert ok.exit_code == 0, ok.output
        assert "llama.cpp b1-0c1e570 · as it reports" in ok.output
