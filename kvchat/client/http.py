"""An HTTP client of `kvchat serve` over httpx, importing neither torch nor transformers.

Replies stream as server-sent events of /generate; closing a stream (or letting Ctrl-C
interrupt it) drops the connection, which cancels the request on the server at its next step.
Every call is under the bounds of `kvchat.client.bounds`, and what the server answers is read
strictly (`kvchat.client.replies`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx

from kvchat.client.bounds import Bounds, Call, Calls, httpx_timeout, limits
from kvchat.client.errors import BadReply, ServerError, ServerGone
from kvchat.client.replies import events, json_body, json_object, json_text

__all__ = ["Client", "ReplyStream", "ServerError", "ServerGone"]

_WHOLE = ((int,), "a whole number")
_NUMBER = ((int, float), "a number")
_TEXT = ((str,), "text")
# What POST /generate answers (`kvchat.responses.result_fields`), which a batch row is read from
# (`result_from_fields`), each with its type: a reply without one of them, or with one of
# another type, is not a /generate reply (and would fail the row's arithmetic).
GENERATE_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "text": _TEXT, "prompt_tokens": _WHOLE, "completion_tokens": _WHOLE,
    "cache_hit_tokens": _WHOLE, "disk_hit_tokens": _WHOLE, "shared_hit_tokens": _WHOLE,
    "hit_source": _TEXT, "miss_reason": _TEXT, "miss_label": _TEXT,
    "diverged_at": ((int, type(None)), "a whole number or null"), "miss_detail": _TEXT,
    "finish_reason": _TEXT, "draft_tokens": _WHOLE, "draft_accepted": _WHOLE,
    "ttft_ms": _NUMBER, "total_ms": _NUMBER}
# Fields a reply has only from a kvchat that knows them (a server started by an earlier kvchat
# lacks them): typed when present, read as 0 when not.
GENERATE_LATER_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {"replayed_tokens": _WHOLE}


def generate_reply(where: str, body: dict[str, Any]) -> dict[str, Any]:
    """A /generate reply whose every field has its type (booleans are not numbers)."""
    later = {k: v for k, v in GENERATE_LATER_FIELDS.items() if k in body}
    for name, (types, kind) in {**GENERATE_FIELDS, **later}.items():
        value = body[name]
        if isinstance(value, bool) or not isinstance(value, types):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 60 else shown[:60] + "..."
            raise BadReply(where, f"has `{name}` that is not {kind}: it is {shown}")
    return body


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


def _error_from(url: str, response: httpx.Response) -> ServerError:
    """The server's {"error": {...}} body as one paragraph (read here if it is not yet); a
    5xx says its status, whatever its body."""
    try:
        body = json_text(url, response.read().decode("utf-8", "replace") or "{}")
        error = body.get("error") or {}
        kind, message = str(error.get("type", "error")), str(error.get("message", ""))
    except (BadReply, AttributeError):
        kind, message = "error", response.text[:200].strip()
    except httpx.HTTPError:
        kind, message = "error", ""
    status = response.status_code
    if status == 401:
        message = (f"{message} The token comes from the sessions dir's lock file, --token or "
                   "$KVCHAT_TOKEN.").strip()
    if status >= 500:
        said = f"The kvchat server at {url} answered HTTP {status} {response.reason_phrase}"
        message = f"{said.strip()}: {message}" if message else f"{said.strip()}."
    return ServerError(status, kind, message or f"HTTP {status}")


class ReplyStream:
    """One streaming reply: iterate for text deltas; afterwards `result` holds the `done`
    event's fields (or `error` what went wrong: an error event, a bound that passed, a reply
    that is not an event stream of JSON). `close()` cancels it on the server."""

    def __init__(self, url: str, response: httpx.Response, context: Any,
                 pid: int | None = None, call: Call | None = None,
                 calls: Calls | None = None) -> None:
        self.url = url
        self.pid = pid
        self.result: dict[str, Any] | None = None
        self.error: str | None = None
        self._response = response
        self._context = context
        self._call = call
        self._calls = calls
        self._closed = False

    def __iter__(self) -> Iterator[str]:
        where = f"{self.url}/generate"
        try:
            for event, payload in events(where, self._response):
                data = json_text(where, payload, "sent an event that is not JSON")
                if not isinstance(data, dict):
                    raise BadReply(where, "sent an event that is not a JSON object")
                if event == "token":
                    yield str(data.get("text", ""))
                elif event == "done":
                    self.result = data
                elif event == "error":
                    self.error = str((data.get("error") or {}).get("message", data))
        except BadReply as exc:
            self.error = str(exc)
        except httpx.HTTPError as exc:
            timeout = self._call.failure(exc) if self._call is not None else None
            if timeout is not None:
                self.error = str(timeout)
            elif not self._closed and not (self._call is not None and self._call.aborted):
                raise _gone(self.url, exc, self.pid, mid_reply=True) from None
        finally:
            self.close()
        if self.result is None and self.error is None and self._call is not None:
            timeout = self._call.failure(None)  # the overall bound shut the stream
            self.error = str(timeout) if timeout is not None else None

    def close(self) -> None:
        """Drop the connection: the server cancels the request if it is still running."""
        if not self._closed:
            self._closed = True
            try:
                self._context.__exit__(None, None, None)
            finally:
                if self._calls is not None and self._call is not None:
                    self._calls.end(self._call)


class Client:
    """`kvchat serve` at `url`, called with `token` (None: a server run with --no-auth);
    `pid`, when known (the lock file's), tells a server that does not answer from one that is
    gone. Every call is under `bounds`; `close()` hangs up the calls in flight."""

    def __init__(self, url: str, token: str | None = None, pid: int | None = None,
                 bounds: Bounds | None = None) -> None:
        self.url = url.rstrip("/")
        self.pid = pid
        self.bounds = bounds or Bounds()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._calls = Calls(self.url, self.bounds)
        self._http = httpx.Client(base_url=self.url, headers=headers,
                                  timeout=httpx_timeout(self.bounds), limits=limits())

    def close(self) -> None:
        self._calls.abort_all()
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _response(self, method: str, path: str, silent: bool = False,
                  **kwargs: Any) -> httpx.Response:
        """The whole response to one call, under the bounds; an HTTP error status raises."""
        with self._calls.one(silent) as call:
            try:
                response = self._http.request(method, path, **call.options(), **kwargs)
            except httpx.HTTPError as exc:
                raise call.failure(exc) or _gone(self.url, exc, self.pid) from None
            timeout = call.failure(None)
        if timeout is not None:
            raise timeout
        if response.status_code >= 400:
            raise _error_from(self.url, response)
        return response

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        return json_body(f"{self.url}{path}", self._response(method, path, **kwargs))

    # ---- generation ----

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /generate without streaming: the reply's fields. Nothing comes until the reply
        is done, so only the connect and overall bounds apply."""
        response = self._response("POST", "/generate", silent=True,
                                  json={**body, "stream": False})
        where = f"{self.url}/generate"
        return generate_reply(where, json_object(where, response, tuple(GENERATE_FIELDS)))

    def stream(self, body: dict[str, Any]) -> ReplyStream:
        """POST /generate with "stream": true; errors before the first event raise here."""
        call = self._calls.start()
        context = self._http.stream("POST", "/generate", json={**body, "stream": True},
                                    **call.options())
        try:
            response = context.__enter__()
        except httpx.HTTPError as exc:
            self._calls.end(call)
            raise call.failure(exc) or _gone(self.url, exc, self.pid) from None
        except BaseException:
            self._calls.end(call)
            raise
        if response.status_code >= 400:
            try:
                error = _error_from(self.url, response)
            finally:
                context.__exit__(None, None, None)
                self._calls.end(call)
            raise call.failure(None) or error
        return ReplyStream(self.url, response, context, self.pid, call, self._calls)

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
