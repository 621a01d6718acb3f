"""An HTTP client of any OpenAI-compatible server (llama.cpp's llama-server, vLLM, SGLang, kvchat
serve), over httpx, importing neither torch nor transformers.

It speaks only what those servers share: GET /v1/models, streamed POST /v1/chat/completions with
`stream_options.include_usage` (the last chunk carries `usage`), and plain GETs of the engines'
own info endpoints for detection. What a reply reports is read as it is: `cached_tokens` is
None when the server did not say, never 0 by guess.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import httpx

from kvchat.client.http import CALL_TIMEOUT_S, CONNECT_TIMEOUT_S, ServerError, ServerGone


class Usage(NamedTuple):
    """A reply's `usage`, as the server reported it (None: not reported)."""

    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens
    prefill_ms: float | None = None  # llama.cpp's timings.prompt_ms

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Usage:
        usage = body.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        timings = body.get("timings") or {}
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
    return ServerError(status, kind, message or f"HTTP {status} from {url}")


class CompletionStream:
    """One streamed chat completion: iterate for text deltas. `prefilled` is set once the
    first text (or the end) arrives, which is when the server has computed the prompt;
    afterwards `result` holds the Completion, or `error` what went wrong. `close()` hangs up,
    which stops the request on servers that notice (all four do)."""

    def __init__(self, url: str, response: httpx.Response, context: Any, started: float) -> None:
        self.url = url
        self.result: Completion | None = None
        self.error: str | None = None
        self.prefilled = threading.Event()
        self._response = response
        self._context = context
        self._started = started
        self._closed = False

    def __iter__(self) -> Iterator[str]:
        parts: list[str] = []
        finish, ttft = "", None
        last: dict[str, Any] = {}
        try:
            for data in self._events():
                if "error" in data and "choices" not in data:
                    self.error = _message(data["error"])
                    break
                last = data if data.get("usage") else last
                for choice in data.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text:
                        if ttft is None:
                            ttft = (time.perf_counter() - self._started) * 1000
                            self.prefilled.set()
                        parts.append(text)
                        yield text
                    finish = choice.get("finish_reason") or finish
        except httpx.HTTPError as exc:
            if not self._closed:
                raise unreachable(self.url, exc) from None
        finally:
            self.prefilled.set()
            self.close()
        if self.error is None and (finish or last):
            total = (time.perf_counter() - self._started) * 1000
            self.result = _completion("".join(parts), finish or "stop", last, ttft, total)

    def _events(self) -> Iterator[dict[str, Any]]:
        for line in self._response.iter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                return
            try:
                data = json.loads(payload)
            except ValueError:
                continue
            if isinstance(data, dict):
                yield data

    def drain(self, on_text: Callable[[str], None] | None = None) -> Completion:
        """Read the whole reply; raises ServerError when the stream ended with an error."""
        for text in self:
            if on_text is not None:
                on_text(text)
        if self.result is None:
            raise ServerError(502, "stream_error", self.error or
                              f"The reply from {self.url} ended before it finished.")
        return self.result

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._context.__exit__(None, None, None)


def _message(error: Any) -> str:
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


def _completion(text: str, finish: str, last: dict[str, Any], ttft: float | None,
                total: float) -> Completion:
    usage = Usage.from_body(last)
    body = {"id": last.get("id"), "object": "chat.completion", "created": last.get("created"),
            "model": last.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish}],
            "usage": last.get("usage")}
    if last.get("timings"):
        body["timings"] = last["timings"]
    return Completion(text, finish, usage, ttft, total, body)


class OpenAIClient:
    """An OpenAI-compatible server at `url` (with or without a trailing /v1), called with
    `api_key` as its Bearer token (None: none sent)."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        base = url.rstrip("/")
        self.url = base[:-3] if base.endswith("/v1") else base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(CALL_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> OpenAIClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, path: str) -> httpx.Response:
        """A GET, whatever its status (detection reads 404s too); unreachable raises."""
        try:
            return self._http.get(path)
        except httpx.HTTPError as exc:
            raise unreachable(self.url, exc) from None

    def get_json(self, path: str) -> Any:
        """The JSON a GET answers, or None when the path is missing or answers no JSON."""
        response = self.get(path)
        if response.status_code in (401, 403):
            raise refused(self.url, response)
        if response.status_code >= 400:
            return None
        try:
            return response.json()
        except ValueError:
            return None

    def chat(self, body: dict[str, Any]) -> CompletionStream:
        """POST /v1/chat/completions, streamed with usage; errors before the first event
        raise here (ServerError with the server's message, ServerGone)."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        context = self._http.stream("POST", "/v1/chat/completions", json=body,
                                    timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S))
        try:
            response = context.__enter__()
        except httpx.HTTPError as exc:
            raise unreachable(self.url, exc) from None
        if response.status_code >= 400:
            response.read()
            error = refused(self.url, response)
            context.__exit__(None, None, None)
            raise error
        return CompletionStream(self.url, response, context, started)
