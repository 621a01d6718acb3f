"""A batch file through a running kvchat server (`kvchat batch` attached to it): every line is a
POST /generate, sent at once (session lines one after another), so the server batches them with
whatever else it runs.

Rows, progress and summary are the standalone run's (`LineRun`): each reply is read back into
the result it reports (`responses.result_from_fields`) and becomes a row with the same fields,
written as soon as it arrives. Ctrl-C closes the connections (the server cancels those
requests); a server that goes away stops the run. Either way every line gets its row and
`--resume` finishes the rest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

from kvchat.batch.recorder import NOT_FINISHED, ItemResult, LineRun, SaveFailure, line_params
from kvchat.client import Client, ServerError, ServerGone
from kvchat.config import SamplingParams
from kvchat.request_file import BatchItem
from kvchat.responses import result_from_fields

# Requests in flight at once: twice what the server decodes at once (its /healthz
# `batch_size`), enough to keep its batch full; few enough that a line waits at most about one
# other line's time in its queue, since --request-timeout counts that wait (a reply that is not
# streamed says nothing until it is done). MAX_IN_FLIGHT where the server does not say.
IN_FLIGHT_PER_ROW = 2
MAX_IN_FLIGHT = 64


def in_flight(health: dict[str, Any]) -> int:
    """How many lines to send at once to a server whose /healthz said `health`."""
    rows = health.get("batch_size")
    if isinstance(rows, int) and not isinstance(rows, bool) and rows > 0:
        return min(MAX_IN_FLIGHT, IN_FLIGHT_PER_ROW * rows)
    return MAX_IN_FLIGHT


def request_body(item: BatchItem, defaults: SamplingParams, cut_turns_out: bool = False
                 ) -> dict[str, Any]:
    """The /generate body of one line, with the command's defaults for what it leaves out;
    `cut_turns_out`: the server takes "keep_interrupted" (its /healthz says so), and a session
    line cut short is to stay out of its session (--resume sends it again)."""
    params = line_params(item, defaults)
    body: dict[str, Any] = {"max_tokens": params.max_new_tokens,
                            "temperature": params.temperature, "seed": params.seed}
    if item.system is not None:
        body["system"] = item.system
    if item.session is None:
        return {**body, "messages": item.messages}
    if len(item.messages) != 1 or item.messages[0]["role"] != "user":
        raise ValueError("a session line sends one user message to a server; run this file "
                         "with --standalone")
    body = {**body, "prompt": item.messages[0]["content"], "session": item.session,
            "create_session": True}
    # an earlier server refuses the field (its bodies forbid unknown ones): not sent there
    return {**body, "keep_interrupted": False} if cut_turns_out else body


def has_system(item: BatchItem) -> bool:
    return item.system is not None or any(m["role"] == "system" for m in item.messages)


class AttachedRun(LineRun):
    """The lines of a batch file through a server, each result reported as soon as it is in
    (from the thread that sent it)."""

    not_run = NOT_FINISHED

    def __init__(self, client: Client, items: list[BatchItem],
                 defaults: SamplingParams, fail_fast: bool,
                 on_update: Callable[[ItemResult], None], pin_system: bool = False,
                 concurrency: int | None = None) -> None:
        self._lock = threading.Lock()
        super().__init__(items, fail_fast, on_update, self._lock)
        self.client = client
        self.defaults = defaults
        self._saved: dict[str, bool] = {}  # session -> whether the server saved its last turn
        self.stopped = threading.Event()
        self.gone: ServerGone | None = None
        self.pin_system = pin_system  # ask the server to pin each line's system prompt
        self.cut_turns_out = False  # the server keeps a session line cut short out
        self.pinned: dict[str, int] = {}  # pin id -> the first line that pinned it
        self.max_in_flight = concurrency

    def run(self) -> None:
        """Send every line; returns when all are answered. Ctrl-C (KeyboardInterrupt) closes
        the connections, which cancels the requests on the server."""
        chains: dict[str | None, list[list[BatchItem]]] = {}
        sessions: dict[str, list[BatchItem]] = {}
        for item in self.items:
            if item.session is None:
                chains.setdefault(None, []).append([item])
            elif item.session not in sessions:
                sessions[item.session] = [item]
                chains.setdefault(item.session, []).append(sessions[item.session])
            else:
                sessions[item.session].append(item)
        work = [chain for group in chains.values() for chain in group]
        health = self.client.health()
        self.cut_turns_out = health.get("keep_interrupted") is True
        if self.max_in_flight is None:
            self.max_in_flight = in_flight(health)
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_in_flight, len(work)))) as pool:
            futures = [pool.submit(self._chain, chain) for chain in work]
            try:
                _wait_all(futures)
            except BaseException:
                self.stopped.set()
                self.client.close()  # every connection drops: the server cancels them
                for f in futures:
                    f.cancel()
                raise
        if self.gone is not None:
            raise self.gone

    def _chain(self, chain: list[BatchItem]) -> None:
        for item in chain:
            if self.stopped.is_set():
                return
            self._one(item)

    def _one(self, item: BatchItem) -> None:
        try:
            body = request_body(item, self.defaults, self.cut_turns_out)
            if self.pin_system and has_system(item):
                body["pin"] = "system"
            reply = self.client.generate(body)
            self._pin_outcome(item, reply.get("pin"))
            self._save_outcome(item, reply.get("session_error"))
            res = ItemResult(item, result=result_from_fields(reply))
        except ValueError as exc:
            res = ItemResult(item, error=str(exc))
        except ServerError as exc:
            res = ItemResult(item, error=str(exc))
        except ServerGone as exc:
            if self.stopped.is_set():
                return  # Ctrl-C closed the connection: the line stays not finished
            self.gone = self.gone or exc
            self.stopped.set()
            return
        self._record(res)

    def _pin_outcome(self, item: BatchItem, pin: Any) -> None:
        if not isinstance(pin, dict):
            return
        with self._lock:
            if pin.get("error"):
                self.pin_errors.append(f"line {item.line}'s system prompt not pinned: "
                                       f"{pin['error']}")
            elif pin.get("id"):
                self.pinned.setdefault(str(pin["id"]), item.line)

    def _save_outcome(self, item: BatchItem, error: Any) -> None:
        if item.session is None:
            return
        with self._lock:
            self._saved[item.session] = not error
            if error:
                self.save_errors.append(SaveFailure(item.line, item.session, str(error)))

    def behind(self) -> dict[str, str]:
        """The sessions whose last turn the server could not save to its file."""
        return {name: "the server could not save its last turn"
                for name, saved in sorted(self._saved.items()) if not saved}

    def save_behind(self) -> None:
        """The server saves its own sessions (each turn saves the whole session again)."""

    def stop(self) -> None:
        self.stopped.set()


def _wait_all(futures: list[Future[None]]) -> None:
    pending = set(futures)
    while pending:  # short waits: the main thread must stay responsive to Ctrl-C
        done, pending = wait(pending, timeout=0.2, return_when=FIRST_EXCEPTION)
        for f in done:
            f.result()
