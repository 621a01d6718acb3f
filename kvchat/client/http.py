"""An HTTP client of `kvchat serve` over httpx, importing neither torch nor transformers.

Replies stream as server-sent events of /generate; closing a stream (or letting Ctrl-C
interrupt it) drops the connection, which cancels the request on the server at its next step.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx

from kvchat.errors import BackendGone, KvchatError

# Generation can take minutes between two events on a slow device: no read timeout there.
CONNECT_TIMEOUT_S = 5.0
CALL_TIMEOUT_S = 60.0


class ServerError(KvchatError):
    """The server answered with an error (its {"error": {...}} body, made one paragraph)."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


class ServerGone(BackendGone):
    """The server cannot be reached, or went away mid-reply."""


def _alive(pid: int) -> bool:
    """The process runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # no /proc here: kill(0) is all there is to know


def _still_running(pid: int, settle_s: float = 1.0) -> bool:
    """The process still runs after `settle_s`: one dropping its connections may be dying."""
    deadline = time.monotonic() + settle_s
    while _alive(pid):
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)
    return False


def _gone(url: str, exc: Exception, pid: int | None = None,
          mid_reply: bool = False) -> ServerGone:
    """Why the server cannot be reached, as far as this machine can tell: a server process
    that is still alive is not "stopped or killed"."""
    what = "went away during the reply" if mid_reply else "cannot be reached"
    head = f"The kvchat server at {url} {what} ({type(exc).__name__}: {exc})."
    if pid is not None and pid > 0 and _still_running(pid):
        return ServerGone(
            f"{head} Its process (pid {pid}) is still running, so it is not answering at that "
            "address: it may listen elsewhere than the lock file says, still be starting, or "
            f"be stuck. Stop it with `kvchat stop` (or kill {pid}) and start it again, or run "
            "this command with --standalone once it has stopped.")
    if pid is not None and pid > 0:
        why = f"Its process (pid {pid}) has exited: it was stopped or killed."
    elif mid_reply:
        why = "It was stopped or killed."
    else:
        why = "Nothing answers there: it was stopped or killed, or runs elsewhere."
    return ServerGone(f"{head} {why} Start it again with `kvchat serve`, or run this command "
                      "with --standalone.")


def _error_from(response: httpx.Response) -> ServerError:
    try:
        body = json.loads(response.read() or b"{}")
        error = body.get("error") or {}
        kind, message = str(error.get("type", "error")), str(error.get("message", ""))
    except (ValueError, AttributeError):
        kind, message = "error", response.text[:200]
    if response.status_code == 401:
        message = (f"{message} The token comes from the sessions dir's lock file, --token or "
                   "$KVCHAT_TOKEN.").strip()
    return ServerError(response.status_code, kind, message or f"HTTP {response.status_code}")


class ReplyStream:
    """One streaming reply: iterate for text deltas; afterwards `result` holds the `done`
    event's fields (or `error` what went wrong). `close()` cancels it on the server."""

    def __init__(self, url: str, response: httpx.Response, context: Any,
                 pid: int | None = None) -> None:
        self.url = url
        self.pid = pid
        self.result: dict[str, Any] | None = None
        self.error: str | None = None
        self._response = response
        self._context = context
        self._closed = False

    def __iter__(self) -> Iterator[str]:
        event = "message"
        try:
            for line in self._response.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data = json.loads(line[5:])
                    if event == "token":
                        yield str(data.get("text", ""))
                    elif event == "done":
                        self.result = data
                    elif event == "error":
                        self.error = str((data.get("error") or {}).get("message", data))
                    event = "message"
        except httpx.HTTPError as exc:
            if not self._closed:
                raise _gone(self.url, exc, self.pid, mid_reply=True) from None
        finally:
            self.close()

    def close(self) -> None:
        """Drop the connection: the server cancels the request if it is still running."""
        if not self._closed:
            self._closed = True
            self._context.__exit__(None, None, None)


class Client:
    """`kvchat serve` at `url`, called with `token` (None: a server run with --no-auth);
    `pid`, when known (the lock file's), tells a server that does not answer from one that is
    gone."""

    def __init__(self, url: str, token: str | None = None, pid: int | None = None) -> None:
        self.url = url.rstrip("/")
        self.pid = pid
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        timeout = httpx.Timeout(CALL_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise _gone(self.url, exc, self.pid) from None
        if response.status_code >= 400:
            raise _error_from(response)
        return response.json()

    # ---- generation ----

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /generate without streaming: the reply's fields."""
        result: dict[str, Any] = self._call("POST", "/generate", json={**body, "stream": False},
                                            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S))
        return result

    def stream(self, body: dict[str, Any]) -> ReplyStream:
        """POST /generate with "stream": true; errors before the first event raise here."""
        context = self._http.stream("POST", "/generate", json={**body, "stream": True},
                                    timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S))
        try:
            response = context.__enter__()
        except httpx.HTTPError as exc:
            raise _gone(self.url, exc, self.pid) from None
        if response.status_code >= 400:
            error = _error_from(response)
            context.__exit__(None, None, None)
            raise error
        return ReplyStream(self.url, response, context, self.pid)

    # ---- the cache and the sessions ----

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/healthz")
        return result

    def cache_stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/cache/stats")
        return result

    def cache_tree(self, depth: int | None = None, session: str | None = None) -> dict[str, Any]:
        params = {k: v for k, v in (("depth", depth), ("session", session)) if v is not None}
        result: dict[str, Any] = self._call("GET", "/cache/tree", params=params)
        return result

    def sessions(self) -> list[dict[str, Any]]:
        """The caller's sessions: name, turns, updated."""
        result: list[dict[str, Any]] = self._call("GET", "/sessions")["sessions"]
        return result

    def session(self, name: str) -> dict[str, Any] | None:
        """A session's file as the server holds it (None: no such session)."""
        try:
            result: dict[str, Any] = self._call("GET", f"/sessions/{name}")
        except ServerError as exc:
            if exc.status == 404:
                return None
            raise
        return result

    def put_session(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Write a session (its system prompt, messages, tokens and turns) on the server."""
        result: dict[str, Any] = self._call("PUT", f"/sessions/{doc['name']}", json=doc)
        return result

    def pin(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /cache/pin: the pin made ({id, tokens, label, blocks}); 409 raises."""
        result: dict[str, Any] = self._call("POST", "/cache/pin", json=body)
        return result

    def pins(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/cache/pins")
        return result

    def unpin(self, pin_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("DELETE", "/cache/pin", params={"id": pin_id})
        return result

    def explain(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /cache/explain: why `messages` (or the raw `prompt`) would miss the live
        cache."""
        result: dict[str, Any] = self._call("POST", "/cache/explain", json=body)
        return result

    def save(self) -> dict[str, Any]:
        """Write the server's cache snapshot now; returns where and how many tokens."""
        result: dict[str, Any] = self._call("POST", "/cache/save")
        return result
