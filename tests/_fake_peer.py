"""A stand-in OpenAI-compatible engine over loopback, answering in the response shapes of
llama.cpp's llama-server (recorded), vLLM and SGLang (written from their documentation), kept in
tests/fixtures/engines/. vLLM and SGLang cannot run on this machine; these shapes are what kvchat
is tested against for them.

Its "tokens" are the words of the messages; its prefix cache is one for all requests (as vLLM's
and SGLang's): a prompt's cached_tokens are the words it shares with a prompt prefilled before,
and prefill sleeps per computed word, so the order requests arrive in shows in what they report.
"""

from __future__ import annotations

import copy
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures" / "engines"
PREFILL_S_PER_TOKEN = 0.002
DECODE_S_PER_TOKEN = 0.002


def fixture(kind: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{kind}.json").read_text())


def words(messages: list[dict[str, str]]) -> list[str]:
    return [w for m in messages for w in f"<{m['role']}> {m['content']}".split()]


class FakePeer:
    """`kind` is a fixture's name (llamacpp, vllm, sglang). `report_cached=False` answers as
    vLLM does without --enable-prompt-tokens-details (no prompt_tokens_details)."""

    def __init__(self, kind: str, api_key: str | None = None, report_cached: bool = True,
                 reply: str = "the sea is wide and deep and blue and old",
                 fail_from: int | None = None) -> None:
        self.shapes = fixture(kind)
        self.kind = kind
        self.api_key = api_key
        self.report_cached = report_cached
        self.fail_from = fail_from  # requests from this one on: the connection drops (a crash)
        self.reply = reply.split()
        self.cache: list[list[str]] = []  # prefilled prompts
        self.arrivals: list[tuple[float, str, list[dict[str, str]]]] = []  # (when, event, msgs)
        self.bodies: list[dict[str, Any]] = []
        self.running = 0
        self.most_running = 0
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakePeer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def cached(self, prompt: list[str]) -> int:
        best = 0
        for seen in self.cache:
            n = 0
            while n < min(len(seen), len(prompt)) and seen[n] == prompt[n]:
                n += 1
            best = max(best, n)
        return min(best, len(prompt) - 1)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, status: int, body: Any) -> None:
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                if body is not None:
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if engine.api_key is None:
                    return True
                if self.headers.get("Authorization") == f"Bearer {engine.api_key}":
                    return True
                self._json(401, engine.shapes["unauthorized"])
                return False

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    if self._authorized():
                        self._json(200, engine.shapes["models"])
                elif self.path in engine.shapes["info"]:
                    self._json(200, engine.shapes["info"][self.path])
                else:
                    self._json(404, engine.shapes["not_found"])

            def do_POST(self) -> None:
                if self.path != "/v1/chat/completions":
                    self._json(404, engine.shapes["not_found"])
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self._authorized():
                    return
                engine.stream(self, body)

        return Handler

    def _send(self, handler: BaseHTTPRequestHandler, data: dict[str, Any] | str) -> None:
        text = data if isinstance(data, str) else json.dumps(data)
        handler.wfile.write(f"data: {text}\n\n".encode())
        handler.wfile.flush()

    def stream(self, handler: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        messages = body["messages"]
        prompt = words(messages)
        with self.lock:
            self.bodies.append(body)
            if self.fail_from is not None and len(self.bodies) > self.fail_from:
                handler.close_connection = True
                handler.connection.shutdown(socket.SHUT_RDWR)
                return
            self.arrivals.append((time.monotonic(), "arrived", messages))
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            cached = self.cached(prompt)
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()
        try:
            self._send(handler, self.shapes["first_chunk"])
            time.sleep(PREFILL_S_PER_TOKEN * (len(prompt) - cached))
            with self.lock:
                self.cache.append(prompt)
                self.arrivals.append((time.monotonic(), "prefilled", messages))
            n = min(int(body.get("max_tokens") or 16), len(self.reply))
            for i in range(n):
                chunk = copy.deepcopy(self.shapes["chunk"])
                chunk["choices"][0]["delta"]["content"] = ("" if i == 0 else " ") + self.reply[i]
                self._send(handler, chunk)
                time.sleep(DECODE_S_PER_TOKEN)
            finish = copy.deepcopy(self.shapes["finish_chunk"])
            finish["choices"][0]["finish_reason"] = "length" if n < len(self.reply) else "stop"
            self._send(handler, finish)
            usage = copy.deepcopy(self.shapes["usage_chunk"])
            usage["usage"].update(prompt_tokens=len(prompt), completion_tokens=n,
                                  total_tokens=len(prompt) + n)
            if self.report_cached:
                usage["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
            else:
                usage["usage"]["prompt_tokens_details"] = None
            if "timings" in usage:
                usage["timings"].update(cache_n=cached, prompt_n=len(prompt) - cached)
            self._send(handler, usage)
            self._send(handler, "[DONE]")
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            with self.lock:
                self.running -= 1
