"""How long kvchat waits on another server: three bounds on every call (`kvchat.config.Bounds`),
each set by an option.

- connect (--connect-timeout, 10 s): the connection is open. A server that is up accepts in
  milliseconds; 10 s leaves room for a slow network or a TLS handshake far away.
- idle (--idle-timeout, 120 s): the longest a reply may send nothing. A streamed reply sends
  every token as it comes, so a silence that long is a stuck server, or one queueing far more
  than kvchat sends it. A reply that is not streamed (a kvchat server's batch lines) is silent
  until it is done: there the overall bound is the only one.
- total (--request-timeout, 600 s): the whole call, from sending it to its last byte. It ends a
  reply that drips or streams forever; 600 s is 256 tokens at under half a token a second.

The connect and idle bounds are httpx's (each read has the idle bound). The overall one is a
timer: when it passes, the call's socket is shut down, which wakes a read blocked in any thread;
`abort()` does the same when the command is interrupted. Each call has a connection of its own
(no keep-alive), so the socket the timer shuts is that call's alone.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx

from kvchat.client.errors import ReplyTimeout
from kvchat.config import Bounds

__all__ = ["Bounds", "Call", "Calls", "httpx_timeout", "limits"]


def httpx_timeout(bounds: Bounds, silent: bool = False) -> httpx.Timeout:
    """httpx's per-read bounds; `silent`: a reply that sends nothing until it is done."""
    read = bounds.total_s if silent else bounds.idle_s
    return httpx.Timeout(connect=bounds.connect_s, read=read, write=read, pool=bounds.connect_s)


def limits() -> httpx.Limits:
    """No keep-alive: a call's socket is its own, for its overall bound and for abort(). No cap
    on connections either: the callers cap what they send (--concurrency), and a call waiting
    for a free one would pass the connect bound with the server never asked."""
    return httpx.Limits(max_connections=None, max_keepalive_connections=0)


class Call:
    """One call under its bounds. Pass `options()` to httpx; once it raises, `failure(exc)` is
    the ReplyTimeout of the bound that passed (None: no bound did, the server failed); after
    a reply ends, `failure(None)` says whether it ended because the overall bound passed."""

    def __init__(self, url: str, bounds: Bounds, silent: bool = False) -> None:
        self.url = url
        self.bounds = bounds
        self.silent = silent
        self.passed: str | None = None  # "total" once the timer shut the call
        self.aborted = False  # hung up by this client (Ctrl-C, SIGTERM)
        self._sock: socket.socket | None = None
        self._ended = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        if bounds.total_s is not None:
            self._timer = threading.Timer(bounds.total_s, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def options(self) -> dict[str, Any]:
        return {"timeout": httpx_timeout(self.bounds, self.silent),
                "extensions": {"trace": self._trace}}

    def _trace(self, event: str, info: dict[str, Any]) -> None:
        """httpcore's trace hook: the socket, as soon as the connection (or TLS) is made."""
        if event not in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            return
        stream = info.get("return_value")
        sock = stream.get_extra_info("socket") if stream is not None else None
        with self._lock:
            self._sock = sock
            if self.passed is not None or self.aborted:
                self._shut()

    def _expire(self) -> None:
        with self._lock:
            if not self._ended:
                self.passed = "total"
                self._shut()

    def abort(self) -> None:
        """Hang up from any thread: a read waiting in another one fails at once."""
        with self._lock:
            if not self._ended:
                self.aborted = True
                self._shut()

    def _shut(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):  # closed already: nothing waits on it
                self._sock.shutdown(socket.SHUT_RDWR)

    def end(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._ended = True
            self._sock = None

    def failure(self, exc: Exception | None) -> ReplyTimeout | None:
        b = self.bounds
        if self.passed == "total" and b.total_s is not None:
            return ReplyTimeout(self.url, "total", b.total_s)
        if self.aborted:
            return None
        if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
            return ReplyTimeout(self.url, "connect", b.connect_s)
        if isinstance(exc, (httpx.ReadTimeout, httpx.WriteTimeout)):
            if self.silent and b.total_s is not None:
                return ReplyTimeout(self.url, "total", b.total_s)
            if b.idle_s is not None:
                return ReplyTimeout(self.url, "idle", b.idle_s)
        return None


class Calls:
    """A client's calls in flight: closing the client hangs up every one (`abort_all`)."""

    def __init__(self, url: str, bounds: Bounds) -> None:
        self.url = url
        self.bounds = bounds
        self._live: set[Call] = set()
        self._lock = threading.Lock()

    def start(self, silent: bool = False) -> Call:
        call = Call(self.url, self.bounds, silent)
        with self._lock:
            self._live.add(call)
        return call

    def end(self, call: Call) -> None:
        call.end()
        with self._lock:
            self._live.discard(call)

    @contextlib.contextmanager
    def one(self, silent: bool = False) -> Iterator[Call]:
        call = self.start(silent)
        try:
            yield call
        finally:
            self.end(call)

    def abort_all(self) -> None:
        with self._lock:
            live = list(self._live)
        for call in live:
            call.abort()
