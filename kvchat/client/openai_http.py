"""An HTTP client of any OpenAI-compatible server (llama.cpp's llama-server, vLLM, SGLang, kvchat
serve), over httpx, importing neither torch nor transformers.

It speaks only what those servers share: GET /v1/models, streamed POST /v1/chat/completions with
`stream_options.include_usage` (the last chunk carries `usage`), and plain GETs of the engines'
own info endpoints for detection. What a reply reports is read as it is: `cached_tokens` is
None when the server did not say, never 0 by guess. A server that answers a streamed request
with one JSON body is read too. Every call is under the bounds of `kvchat.client.bounds`; a
reply that is not UTF-8, not JSON or not a chat completion fails saying which.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import httpx

from kvchat.client.bounds import Bounds, Call, Calls, httpx_timeout, limits
from kvchat.client.errors import BadReply, HungUp, ServerError, ServerGone
from kvchat.client.replies import events, json_object, json_text, preview


class Usage(NamedTuple):
    """A reply's `usage`, as the server reported it (None: not reported)."""

    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens
    prefill_ms: float | None = None  # llama.cpp's timings.prompt_ms

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Usage:
        """Each statistic optional: one of another type (`"usage": "n/a"`) is not reported."""
        usage = _object(body.get("usage"))
        details = _object(usage.get("prompt_tokens_details"))
        timings = _object(body.get("timings"))
        return cls(_int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")),
                   _int(details.get("cached_tokens")), _float(timings.get("prompt_ms")))


class Completion(NamedTuple):
    """One finished chat completion: its text and what the server reported, with the times
    this client measured (first streamed text, whole reply)."""

    text: str
    finish_reason: str
    usage: Usage
    ttft_ms: float | None
    total_ms: float
    body: dict[str, Any]  # a `chat.completion` object assembled from the stream


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def unreachable(url: str, exc: Exception) -> ServerGone:
    return ServerGone(f"The server at {url} cannot be reached ({type(exc).__name__}: {exc}). "
                      "Check the URL and that the server is running.")


def refused(url: str, response: httpx.Response) -> ServerError:
    """The server's error as one paragraph; a 401 says where the API key comes from."""
    try:
        body = response.json()
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict):
            kind, message = str(error.get("type", "error")), str(error.get("message", ""))
        else:
            kind, message = "error", str(error or body.get("detail", "") or "")
    except (ValueError, AttributeError):
        kind, message = "error", response.text[:200].strip()
    status = response.status_code
    if status in (401, 403):
        message = (f"The server at {url} refused the credentials (HTTP {status}"
                   + (f": {message}" if message else "") + "). Give its API key with --api-key "
                   "or $OPENAI_API_KEY (a kvchat server's token: --token or $KVCHAT_TOKEN).")
    elif status >= 500:
        said = f"The server at {url} answered HTTP {status} {response.reason_phrase}".strip()
        message = f"{said}: {message}" if message else f"{said}."
    return ServerError(status, kind, message or f"HTTP {status} from {url}")


class CompletionStream:
    """One streamed chat completion: iterate for text deltas. `prefilled` is set once the
    first text (or the end) arrives, which is when the server has computed the prompt;
    afterwards `result` holds the Completion, or `error` what went wrong (`failure` the error
    itself when it was not the server's own error event: a bound that passed, a reply that is
    not a chat completion). `close()` hangs up, which stops the request on servers that notice
    (all four do). `text` is what came so far."""

    def __init__(self, url: str, response: httpx.Response, context: Any, started: float,
                 call: Call | None = None, calls: Calls | None = None) -> None:
        self.url = url
        self.where = f"{url}/v1/chat/completions"
        self.result: Completion | None = None
        self.error: str | None = None
        self.failure: ServerError | None = None
        self.prefilled = threading.Event()
        self._parts: list[str] = []
        self._response = response
        self._context = context
        self._started = started
        self._call = call
        self._calls = calls
        self._closed = False

    @property
    def text(self) -> str:
        return "".join(self._parts)

    @property
    def aborted(self) -> bool:
        """This client hung up the call (Ctrl-C, SIGTERM) while the reply was coming."""
        return self._call is not None and self._call.aborted

    @property
    def hung_up(self) -> bool:
        """This client closed the reply (or the client) before it ended."""
        return self._closed or (self._call is not None and self._call.aborted)

    def __iter__(self) -> Iterator[str]:
        finish, ttft = "", None
        last: dict[str, Any] = {}
        try:
            for data in self._chunks():
                if "error" in data and "choices" not in data:
                    self.error = _message(data["error"])
                    break
                last = data if data.get("usage") else last
                for choice in data.get("choices") or ():
                    delta = choice.get("delta") or choice.get("message")  # a JSON body's
                    text = delta.get("content") if isinstance(delta, dict) else None
                    if text:
                        if ttft is None:
                            ttft = (time.perf_counter() - self._started) * 1000
                            self.prefilled.set()
                        self._parts.append(str(text))
                        yield str(text)
                    finish = choice.get("finish_reason") or finish
        except BadReply as exc:
            self._fail(exc)
        except httpx.HTTPError as exc:
            timeout = self._call.failure(exc) if self._call is not None else None
            if timeout is not None:
                self._fail(timeout)
            elif not self.hung_up:
                raise unreachable(self.url, exc) from None
        finally:
            self.prefilled.set()
            self.close()
        timeout = self._call.failure(None) if self._call is not None else None
        if timeout is not None and self.failure is None:
            self._fail(timeout)  # the overall bound shut a stream that looked whole
        if self.error is None and (finish or last):
            total = (time.perf_counter() - self._started) * 1000
            self.result = _completion(self.text, finish or "stop", last, ttft, total)

    def _fail(self, error: ServerError) -> None:
        self.failure = error
        self.error = str(error)

    def _chunks(self) -> Iterator[dict[str, Any]]:
        """The reply's chunks, checked: each a JSON object with a list of `choices` (the last
        may carry only `usage`, or an error its `error`). A JSON body is one whole chunk."""
        where = self.where
        if self._response.headers.get("content-type", "").startswith("application/json"):
            self._response.read()
            yield _checked(where, json_object(where, self._response, ()), "a chat completion")
            return
        for _, payload in events(where, self._response):
            if payload == "[DONE]":
                return
            if payload:
                data = json_text(where, payload, "sent an event that is not JSON")
                yield _checked(where, data, "a chat completion chunk")

    def drain(self, on_text: Callable[[str], None] | None = None) -> Completion:
        """Read the whole reply; raises ServerError when the stream ended with an error."""
        for text in self:
            if on_text is not None:
                on_text(text)
        if self.result is None:
            if self.failure is not None:
                raise self.failure
            raise ServerError(502, "stream_error", self.error or
                              f"The reply from {self.where} ended before it finished "
                              "(no finish_reason, no usage).")
        return self.result

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._context.__exit__(None, None, None)
            finally:
                if self._calls is not None and self._call is not None:
                    self._calls.end(self._call)


def _checked(where: str, data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise BadReply(where, f"is not {what}: it is {preview(json.dumps(data))}")
    choices = data.get("choices")
    if choices is None and ("error" in data or "usage" in data):
        return data
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        has = "has no `choices`" if choices is None else "has `choices` that are not a list"
        raise BadReply(where, f"{has}: it is not {what} ({preview(json.dumps(data))})")
    return data


def json_or_none(response: httpx.Response) -> Any:
    """A response's JSON; None for an error status or a body that is not UTF-8 JSON."""
    if response.status_code >= 400:
        return None
    try:
        return json_text(str(response.url), response.content.decode("utf-8"))
    except (BadReply, UnicodeDecodeError):
        return None


def _message(error: Any) -> str:
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


def _completion(text: str, finish: str, last: dict[str, Any], ttft: float | None,
                total: float) -> Completion:
    usage = Usage.from_body(last)
    body = {"id": last.get("id"), "object": "chat.completion", "created": last.get("created"),
            "model": last.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish}],
            "usage": last.get("usage") if isinstance(last.get("usage"), dict) else None}
    if isinstance(last.get("timings"), dict) and last["timings"]:
        body["timings"] = last["timings"]
    return Completion(text, finish, usage, ttft, total, body)


class OpenAIClient:
    """An OpenAI-compatible server at `url` (with or without a trailing /v1), called with
    `api_key` as its Bearer token (None: none sent). Every call is under `bounds`; `close()`
    hangs up the calls in flight, from any thread."""

    def __init__(self, url: str, api_key: str | None = None,
                 bounds: Bounds | None = None) -> None:
        base = url.rstrip("/")
        self.url = base[:-3] if base.endswith("/v1") else base
        self.bounds = bounds or Bounds()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._calls = Calls(self.url, self.bounds)
        self._http = httpx.Client(base_url=self.url, headers=headers,
                                  timeout=httpx_timeout(self.bounds), limits=limits())

    def close(self) -> None:
        self._calls.abort_all()
        self._http.close()

    def __enter__(self) -> OpenAIClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, path: str) -> httpx.Response:
        """A GET, whatever its status (detection reads 404s too); unreachable raises, and so
        does a bound that passed."""
        with self._calls.one() as call:
            try:
                response = self._http.get(path, **call.options())
            except httpx.HTTPError as exc:
                raise call.failure(exc) or unreachable(self.url, exc) from None
            timeout = call.failure(None)
        if timeout is not None:
            raise timeout
        return response

    def get_json(self, path: str) -> Any:
        """The JSON a GET answers, or None when the path is missing or answers no JSON."""
        response = self.get(path)
        if response.status_code in (401, 403):
            raise refused(self.url, response)
        return json_or_none(response)

    def chat(self, body: dict[str, Any]) -> CompletionStream:
        """POST /v1/chat/completions, streamed with usage; errors before the first event
        raise here (ServerError with the server's message, ReplyTimeout, ServerGone)."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        call = self._calls.start()
        context = self._http.stream("POST", "/v1/chat/completions", json=body,
                                    **call.options())
        try:
            response = context.__enter__()
        except BaseException as exc:
            self._calls.end(call)
            if isinstance(exc, httpx.HTTPError):
                raise call.failure(exc) or self._lost(call, exc) from None
            raise
        if response.status_code >= 400:
            try:
                response.read()
                error: ServerError | ServerGone = refused(self.url, response)
            except httpx.HTTPError as exc:
                error = call.failure(exc) or self._lost(call, exc)
            finally:
                context.__exit__(None, None, None)
                self._calls.end(call)
            raise error
        return CompletionStream(self.url, response, context, started, call, self._calls)

    def _lost(self, call: Call, exc: Exception) -> ServerGone:
        """Why a call that passed no bound failed: this client hung up, or the server is gone."""
        return HungUp(self.url) if call.aborted else unreachable(self.url, exc)
