"""Servers on 127.0.0.1 that misbehave as a stuck or broken engine does, over a raw socket (so a
reply can stop mid-byte, drip, or be bytes no HTTP library would send).

`BadEngine` answers GET /v1/models (and each engine's info endpoint) as vLLM or a kvchat server
would, so that `--connect` finds it; each POST then gets the behaviour its last user message
(or a /generate "prompt") names, one of BEHAVIOURS; any other text gets a good reply.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable

SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Connection: close\r\n\r\n")
DRIP_S = 0.2


def head(status: int, reason: str, content_type: str, length: int | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {content_type}", "Connection: close"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def whole(status: int, reason: str, content_type: str, body: bytes) -> bytes:
    return head(status, reason, content_type, len(body)) + body


def chunk(text: str, finish: str | None = None) -> bytes:
    data = {"id": "c1", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return f"data: {json.dumps(data)}\n\n".encode()


USAGE = (b'data: {"id": "c1", "choices": [], "usage": {"prompt_tokens": 3, '
         b'"completion_tokens": 2}}\n\ndata: [DONE]\n\n')
GOOD_SSE = SSE_HEAD + chunk("fine") + chunk(" reply", "stop") + USAGE
GOOD_JSON = json.dumps({"id": "c1", "object": "chat.completion", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "whole reply"},
     "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}).encode()
GENERATE_FIELDS = {"text": "fine reply", "prompt_tokens": 3, "completion_tokens": 2,
                   "cache_hit_tokens": 0, "finish_reason": "stop", "ttft_ms": 1.0,
                   "total_ms": 2.0, "hit_source": "miss", "disk_hit_tokens": 0,
                   "shared_hit_tokens": 0, "miss_reason": "", "diverged_at": None,
                   "miss_detail": "", "miss_label": "", "draft_tokens": 0, "draft_accepted": 0,
                   "replayed_tokens": 0}


def ending_with(last: bytes) -> bytes:
    """A good stream whose last chunk holds `last` (its usage and the rest) after `choices`."""
    return (SSE_HEAD + chunk("fine") + chunk(" reply", "stop")
            + b'data: {"id": "c1", "choices": [], ' + last + b"}\n\ndata: [DONE]\n\n")


# What each behaviour sends (bytes at once), or does (a callable given the connection).
CANNED: dict[str, bytes] = {
    # streamed replies (text/event-stream)
    "sse-garbage": SSE_HEAD + b"data: {this is not json\n\n",
    "sse-no-choices": SSE_HEAD + b'data: {"id": "c1", "object": "chat.completion.chunk"}\n\n',
    "sse-not-utf8": SSE_HEAD + b'data: {"choices": [{"delta": {"content": "\xff\xfe"}}]}\n\n',
    "sse-html": SSE_HEAD + b"<html><body>a proxy's error page</body></html>\n",
    # good streams whose optional statistics have the wrong type: read as not reported
    "usage-not-object": ending_with(b'"usage": "oops"'),
    "details-not-object": ending_with(b'"usage": {"prompt_tokens": 3, "completion_tokens": 2, '
                                      b'"prompt_tokens_details": [1]}'),
    "timings-not-object": ending_with(b'"usage": {"prompt_tokens": 3, "completion_tokens": 2}, '
                                      b'"timings": 5'),
    # whole replies (application/json)
    "json-garbage": whole(200, "OK", "application/json", b"{this is not json"),
    "json-no-choices": whole(200, "OK", "application/json", b'{"id": "c1", "object": "x"}'),
    "json-not-utf8": whole(200, "OK", "application/json", b'{"text": "\xff\xfe"}'),
    "json-good": whole(200, "OK", "application/json", GOOD_JSON),
    # errors
    "http-500": whole(500, "Internal Server Error", "application/json",
                      b'{"error": {"message": "model crashed", "type": "server_error"}}'),
    "http-503": whole(503, "Service Unavailable", "text/plain", b"overloaded, try later"),
    # /generate (kvchat server) replies
    "gen-garbage": whole(200, "OK", "application/json", b"<html>oops</html>"),
    "gen-wrong-shape": whole(200, "OK", "application/json", b'{"choices": []}'),
    "gen-not-utf8": whole(200, "OK", "application/json", b'{"text": "\xff"}'),
    "gen-good": whole(200, "OK", "application/json", json.dumps(GENERATE_FIELDS).encode()),
    "gen-sse-garbage": SSE_HEAD + b"event: token\ndata: {nope\n\n",
    "gen-null-tokens": whole(200, "OK", "application/json",
                             json.dumps({**GENERATE_FIELDS, "prompt_tokens": None}).encode()),
    "gen-text-times": whole(200, "OK", "application/json",
                            json.dumps({**GENERATE_FIELDS, "ttft_ms": "fast"}).encode()),
}


class BadEngine:
    """`kind`: "vllm" (an OpenAI-compatible engine) or "kvchat" (a kvchat server)."""

    def __init__(self, kind: str = "vllm", answers_gets: bool = True) -> None:
        self.kind = kind
        self.answers_gets = answers_gets  # False: GETs too are read and never answered
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.posts: list[str] = []  # the behaviour each POST asked for, as it arrived
        self.stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> BadEngine:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        with contextlib.suppress(OSError):
            self.sock.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()

    def wait_posts(self, n: int, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.posts) < n:
            assert time.monotonic() < deadline, f"only {len(self.posts)} of {n} requests came"
            time.sleep(0.02)

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            method, path, body = _read_request(conn)
            if method == "GET" and not self.answers_gets:
                self._silent(conn)
            elif method == "GET":
                conn.sendall(self._info(path))
            else:
                self._behave(conn, _behaviour(body))

    def _info(self, path: str) -> bytes:
        kvchat = self.kind == "kvchat"
        docs = {"/v1/models": {"object": "list", "data": [
                    {"id": "bad-model", "object": "model",
                     "owned_by": "kvchat" if kvchat else "vllm"}]},
                "/version": None if kvchat else {"version": "0.0-bad"},
                "/healthz": {"status": "ok", "model": "bad-model", "device": "cpu",
                             "precision": "float32", "chat_template": True} if kvchat else None}
        doc = docs.get(path)
        if doc is None:
            return whole(404, "Not Found", "application/json", b'{"error": {"message": "no"}}')
        return whole(200, "OK", "application/json", json.dumps(doc).encode())

    def _behave(self, conn: socket.socket, name: str) -> None:
        self.posts.append(name)
        act: Callable[[socket.socket], None] | None = {
            "silent": self._silent, "stall": self._stall, "drip": self._drip,
            "drip-body": self._drip_body,
            "endless": self._endless, "gen-silent": self._silent,
            "one-long-line": self._one_long_line, "hang-up": self._hang_up}.get(name)
        if act is not None:
            act(conn)
        else:
            default = "gen-good" if self.kind == "kvchat" else "good"
            conn.sendall(CANNED.get(name) or CANNED.get(default) or GOOD_SSE)
            conn.shutdown(socket.SHUT_WR)
            self.stop.wait(1.0)  # let the client read before the socket closes

    def _silent(self, conn: socket.socket) -> None:
        """Accepts and reads the request, then never answers."""
        self.stop.wait()

    def _stall(self, conn: socket.socket) -> None:
        """Starts an event stream, then never sends another byte."""
        conn.sendall(SSE_HEAD)
        self.stop.wait()

    def _drip(self, conn: socket.socket) -> None:
        """A byte every DRIP_S from the very first one, the status line's: it never ends."""
        for byte in (SSE_HEAD + b": keep-alive\n" * 10_000):
            if self.stop.wait(DRIP_S):
                return
            conn.sendall(bytes([byte]))

    def _drip_body(self, conn: socket.socket) -> None:
        conn.sendall(SSE_HEAD)
        while not self.stop.wait(DRIP_S):
            conn.sendall(b":")

    def _one_long_line(self, conn: socket.socket) -> None:
        """An event stream whose first line never ends: 64 KiB without a newline every 10 ms."""
        conn.sendall(SSE_HEAD + b"data: ")
        while not self.stop.wait(0.01):
            conn.sendall(b"x" * 65536)

    def _hang_up(self, conn: socket.socket) -> None:
        """Reads the request and closes the connection without a reply, as a dying engine."""
        conn.close()

    def _endless(self, conn: socket.socket) -> None:
        """A well-formed stream of tokens that never finishes."""
        conn.sendall(SSE_HEAD)
        while not self.stop.wait(0.05):
            conn.sendall(chunk("more "))


def _read_request(conn: socket.socket) -> tuple[str, str, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        got = conn.recv(65536)
        if not got:
            raise OSError("closed before the request ended")
        data += got
    header, _, body = data.partition(b"\r\n\r\n")
    lines = header.decode("latin-1").split("\r\n")
    method, path = lines[0].split()[:2]
    length = next((int(line.split(":", 1)[1]) for line in lines[1:]
                   if line.lower().startswith("content-length:")), 0)
    while len(body) < length:
        got = conn.recv(65536)
        if not got:
            break
        body += got
    return method, path, body


def _behaviour(body: bytes) -> str:
    doc = json.loads(body or b"{}")
    if "prompt" in doc:
        return str(doc["prompt"])
    users = [m["content"] for m in doc.get("messages", []) if m.get("role") == "user"]
    return str(users[-1]) if users else "good"
