"""`kvchat serve`: the HTTP front end over the engine (FastAPI on uvicorn).

One engine thread owns the Scheduler: it runs `step()` while there is work and sleeps on an
Event when there is none. Everything that touches the scheduler or the cache - submitting,
stepping, stats, the tree, integrity checks, the snapshot - runs on that thread between two
steps (a handler posts a call and awaits its future), so no lock is ever held across a forward
pass. Prompts are templated and tokenised in a worker thread before they are submitted. Text
deltas and results travel back to the event loop with `loop.call_soon_threadsafe`, into one
asyncio queue per request.

A request whose client goes away is cancelled: the scheduler stops it at the next step and
stores the K/V it computed, like any interrupted request.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import json
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as AsgiMessage

from kvchat import __version__
from kvchat.batch import chat_completion, openai_finish_reason, result_fields
from kvchat.config import ConfigError, SamplingParams
from kvchat.engine.backend import GenerationResult, PromptTooLongError
from kvchat.engine.backend import Request as EngineRequest
from kvchat.engine.scheduler import RequestCancelled, Scheduler, Ticket
from kvchat.errors import KvchatError
from kvchat.runtime import Runtime, fingerprint, tokenizer_file
from kvchat.sessions import INDEX, Session, SessionError, cache_dir, validate_name
from kvchat.turns import next_prompt, record_turn
from kvchat.ui import cache_view as cv

log = logging.getLogger("kvchat.server")

T = TypeVar("T")
DEFAULT_BATCH_SIZE = 8
DEFAULT_MAX_TOKENS = 256
# Far above any prompt a model's context holds; stops a runaway body before it is parsed.
MAX_BODY_BYTES = 8 * 1024 * 1024
# On shutdown, how long requests in flight may finish before they are interrupted (their K/V
# stays cached); uvicorn cancels whatever is left BACKSTOP_S later.
GRACEFUL_SHUTDOWN_S = 5.0
BACKSTOP_S = 5.0


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach; a host name other than localhost is
    not known to be one."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_warning(host: str) -> str | None:
    if is_loopback(host):
        return None
    return (
        f"--host {host} is not a loopback address: anyone who can reach this machine can use "
        "the model, read the cache tree (it holds prompt text) and write sessions. kvchat "
        "serve has no authentication."
    )


def log_to_stderr() -> None:
    """Show the server's own messages (startup, snapshot saved) the way uvicorn shows its."""
    from uvicorn.logging import DefaultFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


# ---- errors ----------------------------------------------------------------------------------


class ApiError(Exception):
    """An error the client caused or should know about, sent as {"error": {message, type}}."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


class EngineStopped(KvchatError):
    pass


def error_response(status: int, kind: str, message: str) -> JSONResponse:
    # param and code as OpenAI's error objects carry them, so its clients parse ours
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=status)


def api_error(exc: BaseException) -> ApiError:
    """The HTTP form of an error raised while preparing or running a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return ApiError(400, "context_length_exceeded", str(exc))
    if isinstance(exc, (SessionError, ConfigError)):
        return ApiError(400, "invalid_request_error", str(exc))
    if isinstance(exc, RequestCancelled):
        return ApiError(499, "cancelled", "The request was cancelled before it started.")
    if isinstance(exc, EngineStopped):
        return ApiError(503, "unavailable", str(exc))
    if isinstance(exc, KvchatError):
        return ApiError(400, "invalid_request_error", str(exc))
    return ApiError(500, "server_error", f"{type(exc).__name__}: {exc}")


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return f"The body is not valid JSON ({detail} at position {err['loc'][-1]})."
        where = ".".join(str(p) for p in err.get("loc", ())[1:]) or "body"
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)


# ---- request bodies --------------------------------------------------------------------------


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class GenerateBody(BaseModel):
    """POST /generate. Unknown fields are errors, so a misspelt option is not silently lost."""

    model_config = ConfigDict(strict=True, extra="forbid")
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    system: str | None = None
    session: str | None = None
    create_session: bool = False
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False

    @field_validator("session")
    @classmethod
    def _valid_name(cls, name: str | None) -> str | None:
        if name is not None:
            try:
                validate_name(name)
            except SessionError as exc:
                raise ValueError(str(exc)) from None
        return name

    @model_validator(mode="after")
    def _one_input(self) -> GenerateBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError('give exactly one of "prompt" or "messages"')
        if self.session is not None and self.prompt is None:
            raise ValueError('a session turn sends the new user message as "prompt"')
        if self.create_session and self.session is None:
            raise ValueError('"create_session" needs a "session" name')
        return self


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # extra fields ("name", tool-call fields) are ignored, as OpenAI clients may send them
    model_config = ConfigDict(strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionBody(BaseModel):
    """POST /v1/chat/completions: the subset kvchat implements. Other OpenAI fields are
    accepted and ignored, so an SDK's defaults never fail a request."""

    model_config = ConfigDict(strict=True)
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(s for s in stop if s)


# ---- the engine thread -----------------------------------------------------------------------


@dataclass
class PendingTurn:
    """A session turn to record once its request finishes."""

    session: Session
    user_text: str


Prepared = tuple[EngineRequest, PendingTurn | None]  # a request and the turn it makes


class Handle:
    """One request as the event loop sees it. The engine thread calls `text`, `finish` and
    `fail`; the loop reads `deltas` (None ends them), then `result` or `error`."""

    def __init__(self, request: EngineRequest, turn: PendingTurn | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.request = request
        self.turn = turn
        self.deltas: asyncio.Queue[str | None] = asyncio.Queue()
        self.done = asyncio.Event()
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.cancel_event = threading.Event()
        self._callbacks: list[Callable[[], None]] = []

    # engine thread
    def text(self, delta: str) -> None:
        self._post(self.deltas.put_nowait, delta)

    def finish(self, result: GenerationResult) -> None:
        self._post(self._resolve, result, None)

    def fail(self, error: BaseException) -> None:
        self._post(self._resolve, None, error)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self.loop.call_soon_threadsafe(fn, *args)

    # event loop
    def _resolve(self, result: GenerationResult | None, error: BaseException | None) -> None:
        self.result, self.error = result, error
        self.deltas.put_nowait(None)
        self.done.set()
        for callback in self._callbacks:
            callback()

    def on_done(self, callback: Callable[[], None]) -> None:
        if self.done.is_set():
            callback()
        else:
            self._callbacks.append(callback)

    async def stream(self) -> AsyncIterator[str]:
        while (delta := await self.deltas.get()) is not None:
            yield delta

    # any thread
    def cancel(self) -> None:
        """Stop at the next step (or before it starts); a no-op once finished."""
        self.cancel_event.set()


@dataclass
class ServerCounters:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0  # the client went away before the reply was complete
    errors: int = 0


class Engine:
    """The Scheduler on its own thread, and the only code that touches it or the cache."""

    def __init__(self, runtime: Runtime, batch_size: int = DEFAULT_BATCH_SIZE) -> None:
        self.runtime = runtime
        self.scheduler = Scheduler(runtime.backend, batch_size, on_finish=self._finished)
        self.counters = ServerCounters()
        self.saved_to: Path | None = None
        self._inbox: deque[Callable[[], None]] = deque()
        self._inbox_lock = threading.Lock()
        self._accepting = True
        self._stopping = False
        self._wake = threading.Event()
        self._handles: dict[int, Handle] = {}
        self._thread = threading.Thread(target=self._run, name="kvchat-engine", daemon=True)
        self._close_lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- posting work (any thread) ----

    def _post(self, job: Callable[[], None]) -> None:
        with self._inbox_lock:
            if not self._accepting:
                raise EngineStopped("The server is shutting down.")
            self._inbox.append(job)
        self._wake.set()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run fn on the engine thread between two steps."""
        future: Future[T] = Future()

        def job() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # delivered to whoever awaits the future
                    future.set_exception(exc)

        self._post(job)
        return future

    def submit(self, handle: Handle) -> None:
        self._post(lambda: self._admit(handle))

    def interrupt(self) -> None:
        """Stop every request in flight at the next step: each finishes as interrupted, with
        what it computed cached."""

        def cancel_all() -> None:
            for handle in self._handles.values():
                handle.cancel()

        with contextlib.suppress(EngineStopped):
            self._post(cancel_all)

    # ---- the engine thread ----

    def _run(self) -> None:
        try:
            while True:
                self._drain()
                if self._stopping:
                    break
                if self.scheduler.idle:
                    self._wake.wait()
                    self._wake.clear()  # anything posted since is picked up by the next drain
                    continue
                try:
                    self.scheduler.step()
                except Exception as exc:
                    log.exception("A scheduler step failed; failing the requests in flight.")
                    self._abort(exc)
        finally:
            with self._inbox_lock:
                self._accepting = False
            self._drain()
            self._abort(EngineStopped("The server is shutting down."))

    def _drain(self) -> None:
        while self._inbox:
            self._inbox.popleft()()

    def _admit(self, handle: Handle) -> None:
        if not self._accepting:
            handle.fail(EngineStopped("The server is shutting down."))
            return
        ticket = self.scheduler.submit(handle.request, on_text=lambda _t, d: handle.text(d))
        ticket.cancel_event = handle.cancel_event  # so a cancel posted before admission counts
        self._handles[ticket.request_id] = handle
        self.counters.requests += 1

    def _finished(self, ticket: Ticket) -> None:
        handle = self._handles.pop(ticket.request_id, None)
        if handle is None:
            return
        if ticket.cancel_event.is_set():
            self.counters.cancelled += 1
        if ticket.error is not None or ticket.result is None:
            if not isinstance(ticket.error, RequestCancelled):
                self.counters.errors += 1
            handle.fail(ticket.error or RequestCancelled("no result"))
            return
        self.counters.completed += 1
        if handle.turn is not None:
            self._record(handle.turn, handle.request, ticket.result)
        handle.finish(ticket.result)

    def _record(self, turn: PendingTurn, request: EngineRequest, result: GenerationResult) -> None:
        # As in the REPL, an interrupted reply is recorded too: its K/V is cached, so the next
        # turn extends exactly what the model saw.
        record_turn(turn.session, turn.user_text, request.prompt_ids, result)
        try:
            self.runtime.store.save(turn.session)
        except OSError:
            log.exception("Could not save session %s.", turn.session.name)

    def _abort(self, error: BaseException) -> None:
        """Running requests store their K/V and finish as interrupted; the others fail."""
        try:
            self.scheduler.abort()
        except Exception:
            log.exception("Stopping the scheduler failed.")
        for handle in self._handles.values():
            handle.fail(error)
        self._handles.clear()

    # ---- stopping ----

    def close(self, save: bool = True) -> Path | None:
        """Stop the thread (requests in flight keep what they computed) and save the cache
        snapshot. Idempotent."""
        with self._close_lock:
            if self._closed:
                return self.saved_to
            self._closed = True
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        if save:
            self.saved_to = self.runtime.save()
        return self.saved_to


# ---- sessions --------------------------------------------------------------------------------


class Sessions:
    """Sessions served so far, loaded once from the sessions dir. Turns of one session run one
    after another, in arrival order (an asyncio lock per session, held until the turn is
    recorded)."""

    def __init__(self, runtime: Runtime) -> None:
        self.store = runtime.store
        self._open: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.turn_locks: dict[str, asyncio.Lock] = {}

    def get(self, name: str, create: bool) -> Session:
        with self._lock:
            session = self._open.get(name)
            if session is None:
                if self.store.exists(name):
                    session = self.store.load(name)
                elif create:
                    session = Session(name)
                    self.store.save(session)
                else:
                    raise ApiError(
                        404, "session_not_found",
                        f"No session {name!r}. Send \"create_session\": true to start it.",
                    )
                self._open[name] = session
            return session


class BodyLimit:
    """Refuse request bodies over `limit` bytes with a JSON 413, whether the size is declared
    (Content-Length) or only seen while reading."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"The request body is larger than {self.limit:,} bytes."
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            await error_response(413, "request_too_large", message)(scope, receive, send)
            return
        seen = 0

        async def limited() -> AsgiMessage:
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, message)
            return msg

        await self.app(scope, limited, send)


# ---- SSE -------------------------------------------------------------------------------------


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


class EventStream(StreamingResponse):
    """Server-sent events for one request, which is cancelled however the response ends (a
    client that disconnects stops its generation at the next step)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], handle: Handle) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        self.handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def wait_result(handle: Handle, request: Request) -> GenerationResult:
    """The finished result; the request is cancelled if the client disconnects first."""
    done = asyncio.ensure_future(handle.done.wait())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        done.cancel()
        gone.cancel()
        if not handle.done.is_set():
            handle.cancel()
    if not handle.done.is_set():
        raise ApiError(499, "cancelled", "The client closed the connection.")
    if handle.error is not None:
        raise api_error(handle.error)
    assert handle.result is not None
    return handle.result


# ---- the app ---------------------------------------------------------------------------------


def model_id(runtime: Runtime) -> str:
    """The name /v1 endpoints report: the --model value (a path's last part), or the embedded
    model's name."""
    from kvchat.models import EMBEDDED_NAME

    spec = runtime.options.model
    if spec is None:
        return EMBEDDED_NAME
    return Path(spec).name if Path(spec).exists() else spec


def create_app(
    runtime: Runtime,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> FastAPI:
    """The kvchat HTTP app over one runtime. Its lifespan starts the engine thread and, on
    shutdown, stops it and saves the cache snapshot."""
    if runtime.cache is None:
        raise KvchatError("kvchat serve needs the shared cache.")
    backend = runtime.backend
    engine = Engine(runtime, batch_size)
    sessions = Sessions(runtime)
    name = model_id(runtime)
    snapshot_print = fingerprint(backend, runtime.model_label)
    ids = itertools.count(1)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if runtime.notice:
            log.warning(runtime.notice)
        log.info("kvchat: %s on %s, batch size %d, %s cached tokens restored.",
                 runtime.model_label, backend.device, batch_size, f"{runtime.restored_tokens:,}")
        try:
            yield
        finally:
            path = await asyncio.to_thread(engine.close)
            if path is not None:
                tokens = runtime.cache.stats().tree_tokens
                log.info("Saved the cache snapshot (%s tokens) to %s.", f"{tokens:,}", path)

    app = FastAPI(title="kvchat", version=__version__, lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    app.state.engine = engine
    app.state.runtime = runtime

    # ---- errors ----

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.kind, exc.message)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "")
        if request.method == "POST" and "json" not in content_type and await request.body():
            return error_response(415, "invalid_request_error",
                                  "Send the body as JSON with Content-Type: application/json.")
        invalid_json = any(e.get("type") == "json_invalid" for e in exc.errors())
        return error_response(400, "invalid_json" if invalid_json else "invalid_request_error",
                              _validation_message(exc))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            exc.status_code, "invalid_request_error")
        return error_response(exc.status_code, kind, str(exc.detail))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("Unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, "server_error", f"{type(exc).__name__}: {exc}")

    # ---- preparing requests (worker thread: templating and tokenising) ----

    def params(max_new: int | None, temperature: float | None, default_temperature: float,
               top_p: float | None, top_k: int | None, seed: int | None,
               stop: str | list[str] | None) -> SamplingParams:
        wanted = max_new if max_new is not None else max_tokens
        if wanted > backend.max_context:
            raise ApiError(400, "invalid_request_error",
                           f"max_tokens must be at most the model's context "
                           f"({backend.max_context:,}), got {wanted:,}.")
        return SamplingParams(
            max_new_tokens=wanted,
            temperature=default_temperature if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=top_k or 0,
            seed=seed,
            stop=_stops(stop),
        )

    def prepare_generate(body: GenerateBody) -> Prepared:
        p = params(body.max_tokens, body.temperature, 0.0, body.top_p, body.top_k, body.seed,
                   body.stop)
        if body.session is None:
            messages = ([m.model_dump() for m in body.messages] if body.messages is not None
                        else [{"role": "user", "content": body.prompt or ""}])
            if body.system is not None and not any(m["role"] == "system" for m in messages):
                messages.insert(0, {"role": "system", "content": body.system})
            request = EngineRequest(backend.encode_chat(messages), p)
            backend.check_request(request)
            return request, None
        session = sessions.get(body.session, body.create_session)
        user_text = body.prompt or ""
        system = session.system
        if body.system is not None:
            session.system = body.system
        request = EngineRequest(next_prompt(backend, session, user_text), p, sid=session.name)
        try:
            backend.check_request(request)
        except KvchatError:
            session.system = system  # the turn never happens: nothing changes
            raise
        return request, PendingTurn(session, user_text)

    def prepare_chat(body: ChatCompletionBody) -> Prepared:
        p = params(body.max_completion_tokens or body.max_tokens, body.temperature, 1.0,
                   body.top_p, None, body.seed, body.stop)
        roles = {"developer": "system"}
        messages = [{"role": roles.get(m.role, m.role), "content": m.text()}
                    for m in body.messages]
        request = EngineRequest(backend.encode_chat(messages), p)
        backend.check_request(request)
        return request, None

    async def start(prepare: Callable[[Any], Prepared], body: Any) -> Handle:
        try:
            handle = Handle(*await run_in_threadpool(prepare, body))
            engine.submit(handle)
        except Exception as exc:
            raise api_error(exc) from exc
        return handle

    # ---- endpoints ----

    @app.post("/generate", response_model=None)
    async def generate(body: GenerateBody, request: Request) -> Any:
        """Generate a reply; with "stream": true, server-sent events: `token` events with text
        deltas, then one `done` event with the stats (or an `error` event)."""
        lock = None
        if body.session is not None:
            lock = sessions.turn_locks.setdefault(body.session, asyncio.Lock())
            await lock.acquire()
        try:
            handle = await start(prepare_generate, body)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        if lock is not None:
            handle.on_done(lock.release)
        extra = {"session": body.session} if body.session else {}
        if not body.stream:
            return {**result_fields(await wait_result(handle, request)), **extra}

        async def events() -> AsyncIterator[bytes]:
            async for delta in handle.stream():
                yield sse({"text": delta}, "token")
            if handle.error is not None:
                err = api_error(handle.error)
                yield sse({"error": {"message": err.message, "type": err.kind}}, "error")
            elif handle.result is not None:
                yield sse({**result_fields(handle.result), **extra}, "done")

        return EventStream(events(), handle)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionBody, request: Request) -> Any:
        """The OpenAI chat completions subset: messages, max_tokens, temperature, top_p, seed,
        stop, stream (chat.completion.chunk events, then `data: [DONE]`)."""
        handle = await start(prepare_chat, body)
        completion_id = f"chatcmpl-kvchat-{next(ids)}"
        if not body.stream:
            return chat_completion(await wait_result(handle, request), completion_id, name)
        created = int(time.time())
        usage = body.stream_options is not None and body.stream_options.include_usage

        def chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
            data: dict[str, Any] = {
                "id": completion_id, "object": "chat.completion.chunk", "created": created,
                "model": name,
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": finish}],
            }
            if usage:
                data["usage"] = None
            return sse(data)

        async def events() -> AsyncIterator[bytes]:
            yield chunk({"role": "assistant", "content": ""})
            async for delta in handle.stream():
                yield chunk({"content": delta})
            if handle.error is not None:
                err = api_error(handle.error)
                yield sse({"error": {"message": err.message, "type": err.kind}})
            elif handle.result is not None:
                r = handle.result
                yield chunk({}, openai_finish_reason(r.finish_reason))
                if usage:
                    yield sse({"id": completion_id, "object": "chat.completion.chunk",
                               "created": created, "model": name, "choices": [],
                               "usage": chat_completion(r, completion_id)["usage"]})
            yield b"data: [DONE]\n\n"

        return EventStream(events(), handle)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list",
                "data": [{"id": name, "object": "model", "created": 0, "owned_by": "kvchat"}]}

    async def on_engine(fn: Callable[[], T]) -> T:
        try:
            return await asyncio.wrap_future(engine.call(fn))
        except EngineStopped as exc:
            raise api_error(exc) from exc

    @app.get("/cache/stats")
    async def cache_stats() -> dict[str, Any]:
        """Hit and miss counts and rates, hit tokens, evictions, pool occupancy, policy,
        per-session counters, and the server's own request counters."""

        def read() -> dict[str, Any]:
            stats = runtime.cache.stats().as_dict()
            sched = engine.scheduler
            stats["server"] = {
                "model": runtime.model_label, "batch_size": sched.batch_size,
                "running": len(sched.running), "pending": len(sched.pending),
                "decode_steps": sched.steps, **vars(engine.counters),
            }
            return stats

        return await on_engine(read)

    @app.get("/cache/tree")
    async def cache_tree(
        depth: int | None = Query(None, ge=1),
        session: str | None = Query(None),
    ) -> dict[str, Any]:
        """The live cache in the schema of `kvchat inspect --json`."""
        if session is not None:
            try:
                validate_name(session)
            except SessionError as exc:
                raise api_error(exc) from exc

        def read() -> tuple[Any, Any, cv.CacheSummary]:
            cache = runtime.cache
            return (cv.nodes_from_cache(cache), cv.exact_from_cache(cache),
                    cv.summary_from_stats(cache.stats()))

        nodes, exact, summary = await on_engine(read)

        def decode(tokens: Any) -> str:
            return backend.decode(list(tokens), skip_special_tokens=False)

        def build() -> dict[str, Any]:
            shown, entries = nodes, exact
            if session is not None:
                shown = cv.owned_by(nodes, session)
                entries = tuple(e for e in exact if cv.covers(shown, e.tokens))
            return {
                "fingerprint": snapshot_print,
                "snapshot": {"path": str(cache_dir(runtime.options.sessions_dir) / INDEX),
                             "saved_at": runtime.last_save, "model_label": runtime.model_label,
                             "tokenizer_file": tokenizer_file(backend.tokenizer),
                             "session": session},
                "stats": cv.stats_json(summary),
                "pool": cv.pool_json(summary),
                "tree": cv.tree_json(shown, decode, depth),
                "exact": cv.exact_json(entries, decode),
            }

        return await run_in_threadpool(build)

    @app.get("/healthz", response_model=None)
    async def healthz() -> Any:
        if not engine.alive:
            return error_response(503, "unavailable", "The engine thread is not running.")
        return {"status": "ok", "model": runtime.model_label, "device": str(backend.device)}

    return app


class Server(uvicorn.Server):
    """uvicorn whose graceful shutdown gives the requests in flight `grace_s` to finish, then
    interrupts them through the engine, so that their replies end normally (finish_reason
    "interrupted") before the lifespan saves the snapshot."""

    def __init__(self, config: uvicorn.Config, grace_s: float = GRACEFUL_SHUTDOWN_S) -> None:
        config.timeout_graceful_shutdown = int(grace_s + BACKSTOP_S)
        super().__init__(config)
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        app: Any = self.config.app
        timer = asyncio.get_running_loop().call_later(self.grace_s, app.state.engine.interrupt)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


@contextlib.contextmanager
def serving(app: FastAPI, host: str = "127.0.0.1", port: int = 0,
            grace_s: float = GRACEFUL_SHUTDOWN_S) -> Iterator[tuple[str, Server]]:
    """Run app with uvicorn on a background thread (tests, embedding); yields its base URL and
    the server, and shuts it down (lifespan included) on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = Server(uvicorn.Config(app, log_level="warning", lifespan="on"), grace_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join()
        sock.close()
