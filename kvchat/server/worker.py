"""The engine thread, and the only server code that touches the engine, the runtime or the
cache.

One thread owns the Engine: it runs `step()` while there is work and sleeps on an Event when
there is none. Everything that touches the engine or the cache - submitting, stepping, stats,
the tree, integrity checks, the snapshot - runs on that thread between two steps (a handler
posts a call and awaits its future), so no lock is ever held across a forward pass. The
engine's events (text deltas, then the result) travel back to the event loop with
`loop.call_soon_threadsafe`, into one asyncio queue per request (a `Handle`, server/handle.py).

A request whose client goes away is cancelled: the engine stops it at the next step and stores
the K/V it computed, like any interrupted request.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from prometheus_client import Histogram

from kvchat.cache.stats import CacheStats
from kvchat.engine.codec import ChatCodec
from kvchat.engine.engine import Engine
from kvchat.engine.handle import RequestCancelled
from kvchat.engine.sequence import Event, Finished, GenerationResult, TextDelta
from kvchat.errors import KvchatError
from kvchat.inspect import documents as cv
from kvchat.runtime import Runtime, tokenizer_file
from kvchat.server.handle import Handle
from kvchat.sessions import SessionStore, cache_dir
from kvchat.snapshots import TREE_INDEX as INDEX
from kvchat.snapshots import not_saved
from kvchat.turns import finish, refused

__all__ = ["DEFAULT_BATCH_SIZE", "CacheTree", "EngineStopped", "EngineWorker", "ModelInfo",
           "ServerCounters", "TenantCounters"]

log = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_BATCH_SIZE = 8
# Time to first token spans a cached hit (milliseconds) to a long prefill on a CPU (minutes).
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                  120.0)


class EngineStopped(KvchatError):
    pass


@dataclass
class ServerCounters:
    """Requests admitted to the engine, and how each ended: exactly one of completed,
    cancelled or errors, so once none is in flight the three add up to `requests`."""

    requests: int = 0
    completed: int = 0  # a result went to a client still waiting for it
    cancelled: int = 0  # the client went away first (its stopped reply is kept), or shutdown
    errors: int = 0
    draft_tokens: int = 0  # reply tokens the cache proposed as drafts
    draft_accepted: int = 0  # of those, the ones verification kept
    replayed_tokens: int = 0  # reply tokens exact repeats took from a stored greedy reply


@dataclass(frozen=True)
class TenantCounters:
    """One tenant's requests and what the cache did for them: what `/cache/stats` shows a
    tenant instead of the whole cache's counters."""

    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    lookups: int = 0  # requests that ran (a result came back)
    hits: int = 0
    exact_hits: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    stored_tokens: int = 0  # tokens its requests added to the cache
    disk_hit_tokens: int = 0  # of hit_tokens, from blocks on disk / in the shared store
    shared_hit_tokens: int = 0

    def plus(self, **deltas: int) -> TenantCounters:
        return replace(self, **{name: getattr(self, name) + n for name, n in deltas.items()})

    def after(self, result: GenerationResult) -> TenantCounters:
        """What a request that ran did with the cache (its outcome is counted apart)."""
        hit = result.cache_hit_tokens
        return self.plus(
            lookups=1, hits=int(hit > 0), exact_hits=int(result.hit_source == "exact"),
            prompt_tokens=result.prompt_tokens, hit_tokens=hit,
            stored_tokens=max(result.stored_tokens - hit, 0),
            disk_hit_tokens=result.disk_hit_tokens, shared_hit_tokens=result.shared_hit_tokens)


@dataclass(frozen=True)
class ModelInfo:
    """What the endpoints report about the model; fixed for the server's life."""

    label: str  # the runtime's model label, as the snapshot records it
    model_id: str  # the name /v1 endpoints report
    device: str
    fingerprint: dict[str, Any]  # of the snapshot this server writes
    precision: str = ""  # what the weights run at, e.g. "int4 weights, bfloat16 compute"


class CacheTree(NamedTuple):
    """The live cache, read on the engine thread, in the views `kvchat inspect` renders."""

    nodes: tuple[cv.NodeView, ...]
    exact: tuple[cv.ExactView, ...]
    stats: CacheStats
    tenants: dict[str, TenantCounters]  # by tenant id ("" the admin)


def _outcome(handle: Handle, event: Finished) -> str:
    """How a request ended, one of ServerCounters' outcomes: a client that went away (or a
    request the engine cancelled before it started) is cancelled, whatever came back."""
    if handle.cancel_event.is_set() or isinstance(event.error, RequestCancelled):
        return "cancelled"
    if event.error is not None or event.result is None:
        return "errors"
    return "completed"


def model_id(runtime: Runtime) -> str:
    """The name /v1 endpoints report: the --model value (a path's last part), or the embedded
    model's name."""
    from kvchat.models.loading import EMBEDDED_NAME

    spec = runtime.options.model
    if spec is None:
        return EMBEDDED_NAME
    return Path(spec).name if Path(spec).exists() else spec


class EngineWorker:
    """The Engine on its own thread, and the only code that touches it or the cache."""

    def __init__(self, runtime: Runtime, batch_size: int = DEFAULT_BATCH_SIZE) -> None:
        if runtime.cache is None:
            raise KvchatError("kvchat serve needs the shared cache.")
        self.runtime = runtime
        self.engine: Engine = runtime.engine
        self.engine.batch_size = batch_size
        self.counters = ServerCounters()
        # observed on the engine thread, read by /metrics (prometheus_client locks it)
        self.ttft = Histogram("kvchat:time_to_first_token_seconds", "Time to first token of "
                              "requests that finished.", buckets=TTFT_BUCKETS_S, registry=None)
        self.tenants: dict[str, TenantCounters] = {}  # engine thread only
        self.info = ModelInfo(runtime.model_label, model_id(runtime), str(self.engine.device),
                              runtime.fingerprint,
                              self.engine.runner.precision_label)
        self.saved_to: Path | None = None
        self.save_error: str | None = None  # the paragraph for a snapshot `close` could not save
        self._inbox: deque[Callable[[], None]] = deque()
        self._inbox_lock = threading.Lock()
        self._accepting = True
        self._stopping = False
        self._wake = threading.Event()
        self._handles: dict[int, Handle] = {}
        self._thread = threading.Thread(target=self._run, name="kvchat-engine", daemon=True)
        self._close_lock = threading.Lock()
        self._closed = self._reported = False

    @property
    def codec(self) -> ChatCodec:
        """The model's tokenizer and chat template; request preparation uses it off-thread."""
        return self.engine.codec

    @property
    def store(self) -> SessionStore:
        return self.runtime.store

    def start(self) -> None:
        self._thread.start()
        runtime = self.runtime
        if runtime.notice:
            log.warning(runtime.notice)
        log.info("kvchat: %s on %s, batch size %d, %s cached tokens restored.",
                 runtime.model_label, self.info.device, self.engine.batch_size,
                 f"{runtime.restored_tokens:,}")

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

    # ---- reading the cache (any thread; the reads run on the engine thread) ----

    def stats(self) -> Future[dict[str, Any]]:
        """The cache's stats as a JSON object, with the server's counters under "server"."""

        def read() -> dict[str, Any]:
            stats: dict[str, Any] = self.runtime.cache.stats().to_json()
            engine = self.engine
            stats["server"] = {
                "model": self.runtime.model_label, "batch_size": engine.batch_size,
                "running": engine.running, "pending": engine.waiting,
                "decode_steps": engine.steps, **vars(self.counters),
                "tenants": {t: vars(c) for t, c in sorted(self.tenants.items()) if t},
            }
            return stats

        return self.call(read)

    def disk_tier(self) -> dict[str, Any] | None:
        """The disk tier's files (any thread: the store locks itself), as `tiers_json` lists
        them; None without a tier."""
        store = self.runtime.disk
        if store is None:
            return None
        st = store.stats()
        return {"blocks": st.blocks, "bytes": st.bytes, "budget_bytes": st.budget_bytes,
                "path": store.describe()}

    def tree(self) -> Future[CacheTree]:
        def read() -> CacheTree:
            cache = self.runtime.cache
            return CacheTree(cv.nodes_from_cache(cache), cv.exact_from_cache(cache),
                             cache.stats(), dict(self.tenants))

        return self.call(read)

    def snapshot_info(self) -> dict[str, Any]:
        """Where the snapshot is saved, and when it was last, as `kvchat inspect --json` says."""
        runtime = self.runtime
        return {"path": str(cache_dir(runtime.options.sessions_dir) / INDEX),
                "saved_at": runtime.last_save, "model_label": runtime.model_label,
                "tokenizer_file": tokenizer_file(self.codec.tokenizer)}

    # ---- the engine thread ----

    def _run(self) -> None:
        try:
            while True:
                self._drain()
                if self._stopping:
                    break
                if self.engine.idle:
                    self._wake.wait()
                    self._wake.clear()  # anything posted since is picked up by the next drain
                    continue
                self.engine.step()  # a failure fails only the requests it touched
                for line in self.runtime.take_notices():  # e.g. a shared store gone: one line
                    log.warning(line)
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
        try:
            engine_handle = self.engine.submit(handle.request,
                                               lambda event: self._event(handle, event))
        except KvchatError as exc:
            refused(handle.turn, exc)
            handle.fail(exc)
            return
        handle.attach(engine_handle)
        self._handles[engine_handle.request_id] = handle
        self.counters.requests += 1
        self._count(handle, requests=1)

    def _event(self, handle: Handle, event: Event) -> None:
        if isinstance(event, TextDelta):
            handle.text(event.text)
        elif isinstance(event, Finished):
            self._finished(handle, event)

    def _finished(self, handle: Handle, event: Finished) -> None:
        if handle.request_id is not None:
            self._handles.pop(handle.request_id, None)
        outcome = _outcome(handle, event)
        setattr(self.counters, outcome, getattr(self.counters, outcome) + 1)
        self._count(handle, **{outcome: 1})
        # As in the REPL, an interrupted reply is recorded too (unless the request said
        # "keep_interrupted": false): its K/V is cached, so the next turn extends exactly what
        # the model saw.
        done = finish(handle.turn, event, handle.store, self._after(handle))
        if done.result is None:
            handle.fail(done.error or RequestCancelled("The request did not run."))
            return
        if done.save_error is not None and handle.turn.session is not None:
            log.error("Could not save session %s: %s", handle.turn.session.name,
                      done.save_error)
            handle.session_error = done.save_error  # the reply still goes out, and says so
        self.counters.draft_tokens += done.result.draft_tokens
        self.counters.draft_accepted += done.result.draft_accepted
        self.counters.replayed_tokens += done.result.replayed_tokens
        self.ttft.observe(done.result.ttft_ms / 1000)
        self.tenants[handle.tenant] = self.tenants.get(handle.tenant,
                                                       TenantCounters()).after(done.result)
        handle.finish(done.result)

    @staticmethod
    def _after(handle: Handle) -> Callable[[GenerationResult], None] | None:
        """The handle's finishing step (a `pin` option), guarded: the reply still goes out
        when it fails, and it reports its own failures."""
        after = handle.after
        if after is None:
            return None

        def guarded(result: GenerationResult) -> None:
            try:
                after(result)
            except Exception:
                log.exception("A request's finishing step failed.")

        return guarded

    def _count(self, handle: Handle, **deltas: int) -> None:
        self.tenants[handle.tenant] = self.tenants.get(handle.tenant, TenantCounters()).plus(
            **deltas)

    def _abort(self, error: BaseException) -> None:
        """Running requests store their K/V and finish as interrupted; the others fail."""
        try:
            self.engine.abort()
        except Exception:
            log.exception("Stopping the engine failed.")
        for handle in list(self._handles.values()):
            handle.fail(error)
        self._handles.clear()

    # ---- stopping ----

    def close(self, save: bool = True) -> Path | None:
        """Stop the thread (requests in flight keep what they computed) and save the cache
        snapshot. Idempotent. A save that fails (a full disk, a read-only folder) leaves the
        previous snapshot as it was and sets `save_error` instead of raising: it is the last
        step of a shutdown, which has nothing left to unwind."""
        with self._close_lock:
            if self._closed:
                return self.saved_to
            self._closed = True
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        if save:
            try:
                self.saved_to = self.runtime.save()
            except (KvchatError, OSError) as exc:
                self.save_error = not_saved(self.runtime.options.sessions_dir, exc)
        return self.saved_to

    def close_and_report(self) -> None:
        """`close`, then say where the snapshot went, or in one paragraph why it was not saved
        (the lifespan's last step; said once, however often it is called)."""
        path = self.close()
        with self._close_lock:
            if self._reported:
                return
            self._reported = True
        if self.save_error is not None:
            log.error(self.save_error)
        elif path is not None:
            tokens = self.runtime.cache.stats().tree_tokens
            log.info("Saved the cache snapshot (%s tokens) to %s.", f"{tokens:,}", path)
