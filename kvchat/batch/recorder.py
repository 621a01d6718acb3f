"""What every way of running a batch file shares: each line's result recorded once as it comes
in (the progress counters, --fail-fast, the row written by the command's `on_update`), the
results in input order, and a result for each line that never ran.

The runners subclass `LineRun`: `BatchRun` (the engine in this process, run.py), `AttachedRun`
(a kvchat server, attached.py) and `PeerRun` (a peer: another OpenAI-compatible engine,
peer.py).
The command (`kvchat.cli.batch`) drives any of them through this class alone.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvchat.cache.stats import ratio
from kvchat.config import SamplingParams, merge_params
from kvchat.request_file import BatchItem

if TYPE_CHECKING:
    from kvchat.batch.peer import PeerReply
    from kvchat.engine.result import GenerationResult

def line_params(item: BatchItem, defaults: SamplingParams) -> SamplingParams:
    """A line's sampling parameters: what it sets over the run's defaults (every runner's one
    rule)."""
    return merge_params(defaults, item.max_tokens, item.temperature, seed=item.seed)


COMPLETE = ("stop", "length")  # the finish reasons of a finished reply
NOT_STARTED = "not run: the batch stopped before this line started"
NOT_FINISHED = "not run: the batch stopped before this line finished"


@dataclass
class ItemResult:
    item: BatchItem
    result: GenerationResult | PeerReply | None = None  # kvchat's own, or another engine's
    error: str | None = None
    not_started: bool = False  # the run stopped before this line started

    @property
    def cut_short(self) -> bool:
        """A reply the run stopped before it finished: its row says so and --resume runs its
        line again."""
        return self.result is not None and self.result.finish_reason == "interrupted"


@dataclass(frozen=True)
class SaveFailure:
    """A session turn that ran (its row is written) but whose session file could not be
    saved: the session on disk is behind by that turn until a later save succeeds."""

    line: int | None  # None: the retry when the run ended
    session: str
    message: str


@dataclass
class BatchProgress:
    done: int = 0  # results recorded: every kind below
    failed: int = 0
    cut_short: int = 0  # replies a stopped run ended before they finished (--resume reruns)
    not_started: int = 0  # lines a stopped run never started
    prompt_tokens: int = 0
    hit_tokens: int = 0
    completion_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def hit_rate(self) -> float:
        return ratio(self.hit_tokens, self.prompt_tokens)

    @property
    def finished(self) -> int:
        """Lines whose reply came to its end."""
        return self.done - self.failed - self.cut_short - self.not_started

    @property
    def ended(self) -> int:
        """Lines that ran to their end: finished or failed."""
        return self.finished + self.failed


class LineRun:
    """The lines of a batch file on their way through one engine. A subclass sends them
    (`run`) and reports each line's result to `_record` exactly once, from any thread when it
    passes a lock: `_record` counts it, stops the run at the first failure under --fail-fast
    and hands the result to `on_update` (which writes its row), all under that lock."""

    not_run = NOT_STARTED  # what a line that never ran says

    def __init__(self, items: list[BatchItem], fail_fast: bool,
                 on_update: Callable[[ItemResult], None] | None,
                 lock: contextlib.AbstractContextManager[object] | None = None) -> None:
        self.items = items
        self.fail_fast = fail_fast
        self.on_update = on_update
        self.results: dict[int, ItemResult] = {}
        self.progress = BatchProgress()
        self.save_errors: list[SaveFailure] = []
        self.pinned: Sized = ()  # what --pin-system pinned (the summary counts them)
        self.pin_errors: list[str] = []
        self._record_lock = lock if lock is not None else contextlib.nullcontext()

    def run(self) -> None:
        """Send every line; returns once each has a result or the run stopped."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop sending lines, from any thread (an `on_update` too)."""
        raise NotImplementedError

    def behind(self) -> dict[str, str]:
        """The sessions whose files lack turns whose rows are written, each with how far."""
        return {}

    def save_behind(self) -> None:
        """One more try at saving the sessions `behind` names."""

    def summary_rows(self) -> list[tuple[str, str]]:
        """The runner's own lines in the summary table."""
        return []

    def _record(self, res: ItemResult) -> None:
        with self._record_lock:
            self.results[res.item.line] = res
            p = self.progress
            p.done += 1
            if res.error is not None:
                p.failed += int(not res.not_started)
                p.not_started += int(res.not_started)
                if self.fail_fast:
                    self.stop()
            elif res.result is not None:
                p.cut_short += int(res.cut_short)
                p.prompt_tokens += res.result.prompt_tokens
                p.hit_tokens += res.result.cache_hit_tokens
                p.completion_tokens += res.result.completion_tokens
            if self.on_update is not None:
                self.on_update(res)

    def ordered(self) -> list[ItemResult]:
        """The results so far, in input order."""
        return [self.results[i.line] for i in self.items if i.line in self.results]

    def not_started(self) -> list[ItemResult]:
        """A result for every line that never ran (the run stopped first); not recorded."""
        return [ItemResult(i, error=self.not_run, not_started=True) for i in self.items
                if i.line not in self.results]
