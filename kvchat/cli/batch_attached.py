"""`kvchat batch` attached to a running server: every line is a POST /generate, sent at once
(session lines one after another), so the server batches them with whatever else it runs.

Rows, progress and summary are the standalone run's: each reply becomes a row with the same
fields, written by the same RowWriter as soon as it arrives. Ctrl-C closes the connections
(the server cancels those requests); a server that goes away stops the run. Either way every
line gets its row and `--resume` finishes the rest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, cast

from rich.console import Console
from rich.markup import escape

from kvchat.client import Attachment, Client, ServerError, ServerGone

if TYPE_CHECKING:
    from kvchat.batch import BatchItem, BatchProgress, ItemResult, SaveFailure
    from kvchat.engine.sequence import GenerationResult

# Requests in flight at once: enough to keep a server's batch full, few enough for its queue.
MAX_IN_FLIGHT = 64
NOT_FINISHED = "not run: the batch stopped before this line finished"


class RemoteResult:
    """A /generate reply read as a GenerationResult: its fields are the reply's own, so a row
    built from it holds exactly what the server sent."""

    def __init__(self, reply: dict[str, Any]) -> None:
        self.reply = reply

    def __getattr__(self, name: str) -> Any:
        try:
            return self.reply[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def computed_tokens(self) -> int:
        return int(self.reply["prompt_tokens"]) - int(self.reply["cache_hit_tokens"])

    @property
    def prefill_ms(self) -> float:
        return float(self.reply["ttft_ms"])  # includes queueing: an upper bound


def request_body(item: BatchItem, max_tokens: int, temperature: float,
                 seed: int | None) -> dict[str, Any]:
    """The /generate body of one line, with the command's defaults for what it leaves out."""
    body: dict[str, Any] = {
        "max_tokens": item.max_tokens or max_tokens,
        "temperature": item.temperature if item.temperature is not None else temperature,
        "seed": item.seed if item.seed is not None else seed,
    }
    if item.system is not None:
        body["system"] = item.system
    if item.session is None:
        return {**body, "messages": item.messages}
    if len(item.messages) != 1 or item.messages[0]["role"] != "user":
        raise ValueError("a session line sends one user message to a server; run this file "
                         "with --standalone")
    return {**body, "prompt": item.messages[0]["content"], "session": item.session,
            "create_session": True}


def has_system(item: BatchItem) -> bool:
    return item.system is not None or any(m["role"] == "system" for m in item.messages)


class AttachedRun:
    """The lines of a batch file through a server, each result reported as soon as it is in.
    Offers what the summary needs of a BatchRun: `progress`, `results`, `ordered()`,
    `not_started()`."""

    def __init__(self, client: Client, items: list[BatchItem],
                 defaults: tuple[int, float, int | None], fail_fast: bool,
                 on_update: Callable[[ItemResult], None], pin_system: bool = False,
                 concurrency: int | None = None) -> None:
        from kvchat.batch import BatchProgress

        self.client = client
        self.items = items
        self.defaults = defaults
        self.fail_fast = fail_fast
        self.on_update = on_update
        self.results: dict[int, ItemResult] = {}
        self.progress: BatchProgress = BatchProgress()
        self.save_errors: list[SaveFailure] = []
        self._saved: dict[str, bool] = {}  # session -> whether the server saved its last turn
        self.stopped = threading.Event()
        self.gone: ServerGone | None = None
        self._lock = threading.Lock()
        self.pin_system = pin_system  # ask the server to pin each line's system prompt
        self.pinned: dict[str, int] = {}  # pin id -> the first line that pinned it
        self.pin_errors: list[str] = []
        self.max_in_flight = concurrency or MAX_IN_FLIGHT

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
        from kvchat.batch import ItemResult

        try:
            body = request_body(item, *self.defaults)
            if self.pin_system and has_system(item):
                body["pin"] = "system"
            reply = self.client.generate(body)
            self._pin_outcome(item, reply.get("pin"))
            self._save_outcome(item, reply.get("session_error"))
            res = ItemResult(item, result=cast("GenerationResult", RemoteResult(reply)))
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
        from kvchat.batch import SaveFailure

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

    def _record(self, res: ItemResult) -> None:
        with self._lock:
            self.results[res.item.line] = res
            p = self.progress
            p.done += 1
            if res.error is not None:
                p.failed += 1
                if self.fail_fast:
                    self.stopped.set()
            elif res.result is not None:
                p.prompt_tokens += res.result.prompt_tokens
                p.hit_tokens += res.result.cache_hit_tokens
                p.completion_tokens += res.result.completion_tokens
            self.on_update(res)

    def stop(self) -> None:
        self.stopped.set()

    def ordered(self) -> list[ItemResult]:
        return [self.results[i.line] for i in self.items if i.line in self.results]

    def not_started(self) -> list[ItemResult]:
        from kvchat.batch import ItemResult

        return [ItemResult(i, error=NOT_FINISHED, not_started=True) for i in self.items
                if i.line not in self.results]


def _wait_all(futures: list[Future[None]]) -> None:
    pending = set(futures)
    while pending:  # short waits: the main thread must stay responsive to Ctrl-C
        done, pending = wait(pending, timeout=0.2, return_when=FIRST_EXCEPTION)
        for f in done:
            f.result()


def server_stats(client: Client) -> Any:
    """The server's cache stats for the summary, or None when it cannot say."""
    from kvchat.client.documents import stats_from_document

    try:
        return stats_from_document(client.cache_stats())
    except (ServerError, ServerGone, KeyError, ValueError, TypeError):
        return None


def describe(server: Attachment, ui: Console) -> None:
    ui.print(f"[dim]attached to {escape(server.found)} at {escape(server.url)}[/dim]")

