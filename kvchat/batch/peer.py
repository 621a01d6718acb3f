"""`kvchat batch --connect URL` on an engine other than kvchat serve: every line a streamed
/v1/chat/completions, sent in cache-aware order (`kvchat.batch.order`) with at most
--concurrency in flight.

Rows, progress, crash safety and --resume are the standalone run's: each reply becomes a row
(the fields the engine reports: `cache_hit_tokens` is its `cached_tokens`, null where it
reported none), written by the same RowWriter as soon as it arrives. Session lines continue
sessions kept in this sessions dir. Ctrl-C (or SIGTERM) hangs up every request in flight, whose
lines get an "interrupted" row with the text so far; an engine that goes away stops the run;
either way every line gets its row and `--resume` finishes the rest. A line whose reply passes
one of the client's bounds (`kvchat.client.bounds`), or is not a chat completion, gets an error
row saying which, and the run goes on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

from kvchat.batch.order import SendQueue, input_order, prompt_text, shared_prefix_groups
from kvchat.batch.recorder import NOT_FINISHED, ItemResult, LineRun, SaveFailure, line_params
from kvchat.client.errors import HungUp
from kvchat.client.http import ServerGone
from kvchat.client.openai_http import Completion, CompletionStream, OpenAIClient
from kvchat.client.peer_turns import begin, conversation, record, request_body
from kvchat.config import SamplingParams
from kvchat.errors import KvchatError
from kvchat.request_file import BatchItem

if TYPE_CHECKING:
    from kvchat.batch.order import Group
    from kvchat.client.ledger import Ledger
    from kvchat.client.peers import PeerInfo
    from kvchat.sessions import SessionStore

Message = dict[str, str]


class PeerReply(NamedTuple):
    """A reply as another engine reported it: a row holds only what it reported (its own
    OpenAI body for an OpenAI batch line), not the fields of kvchat's own result."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    reported_cached: int | None  # usage.prompt_tokens_details.cached_tokens
    ttft_ms: float
    total_ms: float
    prefill_ms: float  # the engine's own prompt time (llama.cpp's timings), else 0: unknown
    engine: str
    body: dict[str, Any]

    @classmethod
    def of(cls, reply: Completion, engine: str) -> PeerReply:
        u = reply.usage
        return cls(reply.text, reply.finish_reason, u.prompt_tokens or 0,
                   u.completion_tokens or 0, u.cached_tokens, reply.ttft_ms or 0.0,
                   reply.total_ms, u.prefill_ms or 0.0, engine, reply.body)

    @classmethod
    def interrupted(cls, text: str, total_ms: float, engine: str) -> PeerReply:
        """A reply hung up by Ctrl-C or SIGTERM: the text so far, nothing the engine reported
        (it reports its counts only at the end)."""
        return cls(text, "interrupted", 0, 0, None, 0.0, total_ms, 0.0, engine, {})

    @property
    def cache_hit_tokens(self) -> int:
        return self.reported_cached or 0

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cache_hit_tokens

    def row_fields(self) -> dict[str, Any]:
        """A row's fields: what the engine reported, and the times this client measured."""
        fields: dict[str, Any] = {
            "text": self.text, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cache_hit_tokens": self.reported_cached, "finish_reason": self.finish_reason,
            "ttft_ms": round(self.ttft_ms, 2), "total_ms": round(self.total_ms, 2),
            "engine": self.engine}
        if self.prefill_ms:
            fields["prefill_ms"] = round(self.prefill_ms, 2)
        return fields

    def response_body(self) -> dict[str, Any]:
        return self.body


class PeerRun(LineRun):
    """The lines of a batch file through a remote engine, each result reported as soon as it
    is in (from the thread that sent it)."""

    not_run = NOT_FINISHED

    def __init__(self, client: OpenAIClient, engine: PeerInfo, items: list[BatchItem],
                 defaults: SamplingParams, fail_fast: bool,
                 on_update: Callable[[ItemResult], None], store: SessionStore,
                 ledger: Ledger, order: str = "cache-aware", concurrency: int = 4) -> None:
        self._cond = threading.Condition()
        super().__init__(items, fail_fast, on_update, self._cond)
        self.client, self.engine = client, engine
        self.defaults = defaults
        self.store, self.ledger = store, ledger
        self.order, self.concurrency = order, max(1, concurrency)
        self._behind: dict[str, int] = {}  # session -> turns its file lacks
        self.stopped = threading.Event()
        self.gone: ServerGone | None = None
        self.groups: list[Group] = []
        self._in_flight = 0
        self._crash: BaseException | None = None

    def _plan(self) -> SendQueue:
        chains: dict[str, list[int]] = {}
        single = []
        for item in self.items:
            if item.session is None:
                single.append((item.line, prompt_text(self._messages_of(item))))
            else:
                chains.setdefault(item.session, []).append(item.line)
        self.groups = shared_prefix_groups(single) if self.order == "cache-aware" \
            else input_order([line for line, _ in single])
        if self.order == "cache-aware" and self.engine.per_slot_cache:
            # a group runs in one slot, line after line; groups run side by side in others
            return SendQueue((), [list(g.lines) for g in self.groups] + list(chains.values()))
        return SendQueue(self.groups, list(chains.values()))

    def run(self) -> None:
        """Send every line; returns when all are answered. Ctrl-C closes the connections."""
        queue = self._plan()
        by_line = {item.line: item for item in self.items}
        pool = ThreadPoolExecutor(max_workers=self.concurrency)
        try:
            with self._cond:
                while self._crash is None:
                    while not self.stopped.is_set() and self._in_flight < self.concurrency:
                        line = queue.take()
                        if line is None:
                            break
                        self._in_flight += 1
                        pool.submit(self._one, by_line[line], queue)
                    if self._in_flight == 0 and (queue.empty or self.stopped.is_set()):
                        break
                    self._cond.wait(0.2)  # short: the main thread must stay responsive
        except BaseException:
            self.stopped.set()
            self.client.close()  # every connection drops: the engine stops those requests
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        if self._crash is not None:
            raise self._crash
        if self.gone is not None:
            raise self.gone

    def _one(self, item: BatchItem, queue: SendQueue) -> None:
        try:
            self._send(item, queue)
        except BaseException as exc:  # a bug must stop the run, not hang it
            self._crash = exc
        finally:
            with self._cond:
                queue.done(item.line)
                self._in_flight -= 1
                self._cond.notify_all()

    def _messages_of(self, item: BatchItem) -> list[Message]:
        msgs = [dict(m) for m in item.messages]
        if item.system is not None and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": item.system})
        return msgs

    def _send(self, item: BatchItem, queue: SendQueue) -> None:
        if self.stopped.is_set():
            return
        session, saved = None, None
        stream: CompletionStream | None = None
        sent: float | None = None  # when the request went out
        try:
            params = line_params(item, self.defaults)
            if item.session is None:
                messages = self._messages_of(item)
            else:
                session = self.store.open(item.session)
                saved = (session.system, [dict(m) for m in session.messages])
                *earlier, last = item.messages
                if last["role"] != "user":
                    raise KvchatError("the last message of a session turn must be the user's")
                begin(session, earlier, item.system)
                messages = conversation(session, last["content"])
            sent = time.perf_counter()
            stream = self.client.chat(request_body(self.engine.model, messages, params))

            def prefilled(text: str) -> None:  # the first text: the engine has the prompt
                if not told:
                    told.append(True)
                    with self._cond:
                        queue.prefilled(item.line)
                        self._cond.notify_all()

            told: list[bool] = []
            reply = stream.drain(prefilled)
        except (KvchatError, ValueError) as exc:
            if session is not None and saved is not None:
                session.system, session.messages = saved[0], saved[1]
            if sent is not None and (isinstance(exc, HungUp)
                                     or (stream is not None and stream.aborted)):
                # Ctrl-C or SIGTERM hung up: the line was interrupted, as far as it came
                text = stream.text if stream is not None else ""
                self._record(ItemResult(item, result=PeerReply.interrupted(
                    text, (time.perf_counter() - sent) * 1000, self.engine.kind)))
            elif isinstance(exc, ServerGone):
                self._stop(exc)
            else:
                self._record(ItemResult(item, error=str(exc)))
            return
        self.ledger.record(messages, reply.usage)
        if session is not None:
            record(session, item.messages[-1]["content"], reply, reply.text, reply.ttft_ms,
                   self.engine.kind)
            try:
                self.store.save(session)
                self._behind.pop(session.name, None)
            except KvchatError as exc:  # the reply is still written; only the transcript not
                self.save_errors.append(SaveFailure(item.line, session.name, str(exc)))
                self._behind[session.name] = self._behind.get(session.name, 0) + 1
        self._record(ItemResult(item, result=PeerReply.of(reply, self.engine.kind)))

    def _stop(self, exc: ServerGone) -> None:
        if not self.stopped.is_set():  # not Ctrl-C closing the connections
            self.gone = self.gone or exc
        self.stopped.set()

    def stop(self) -> None:
        self.stopped.set()

    def behind(self) -> dict[str, str]:
        """Sessions whose file lacks turns whose rows are written (a save failed)."""
        return {name: f"{n} turn(s) not on disk" for name, n in self._behind.items()}

    def save_behind(self) -> None:
        """One more try at the sessions a failed save left behind."""
        for name in list(self._behind):
            try:
                self.store.save(self.store.open(name))
                del self._behind[name]
            except KvchatError as exc:
                self.save_errors.append(SaveFailure(None, name, str(exc)))

    def summary_rows(self) -> list[tuple[str, str]]:
        """The summary's own lines for a remote engine: which, in what order, how reported."""
        shared = [g for g in self.groups if len(g.lines) > 1]
        then = ("the rest one after another (its slot keeps the prefix)"
                if self.engine.per_slot_cache else "the rest once it is prefilled")
        how = (f"cache-aware: {len(shared)} shared-prefix group(s) of "
               f"{sum(len(g.lines) for g in shared)} lines, each group's first line alone, "
               f"{then}" if self.order == "cache-aware" else "input order")
        done = [r.result for r in self.results.values() if r.result is not None]
        reported = sum(isinstance(r, PeerReply) and r.reported_cached is not None
                       for r in done)
        rows = [("engine", self.engine.name()), ("order", how),
                ("in flight", f"at most {self.concurrency}")]
        if reported < len(done):
            rows.append(("cached tokens", f"reported for {reported} of {len(done)} replies"))
        return rows
