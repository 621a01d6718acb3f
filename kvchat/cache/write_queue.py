"""WriteQueue: the write-behind queue a block store's `put` fills and one thread of its own
empties, so no store time lands on the decode path.

A queued block stays at the head of the queue (and readable from it) while it is written, and
leaves only after; its bytes count against `max_bytes` until then, and a put over that waits
(or, without `wait`, is dropped). The store says where the bytes go (`write`), and may give the
thread a job before its first write (`first`) and one for when the queue is idle (`idle`).

The queue's condition (`cond`, reentrant) is the store's lock too: the store keeps its own state
under it, and `counts` (the store's reads, writes and failures) with it.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvchat.cache.block_backend import ReadResult, ReadStatus
from kvchat.cache.block_file import BlockKV, BlockLayout

if TYPE_CHECKING:
    import torch

# what `write` returns: run with the lock held as the block leaves the queue (or None)
Settle = Callable[[], None] | None


class Queued(NamedTuple):
    key: str
    tokens: tuple[int, ...]
    kv: BlockKV
    nbytes: int

    @staticmethod
    def of(key: str, tokens: Sequence[int],
           kv: Sequence[tuple[torch.Tensor, torch.Tensor]], layout: BlockLayout) -> Queued:
        """The block copied to the CPU now (the pool slot may be reused once put returns)."""
        from kvchat.cache.block_file import copy_block_kv

        return Queued(key, tuple(int(t) for t in tokens), copy_block_kv(kv, layout, len(tokens)),
                      layout.payload_bytes)


class WriteQueue:
    """Blocks waiting to be written, and the one thread that writes them (see the module
    docstring). `start` the thread; `close` drains the queue, then stops it."""

    def __init__(self, write: Callable[[Queued], Settle], *, max_bytes: int, name: str,
                 first: Callable[[], None] | None = None,
                 idle: tuple[Callable[[], float | None], Callable[[], None]] | None = None
                 ) -> None:
        """`idle`: (seconds until the idle job is due, or None for never, asked with the lock
        held; the job, run without it)."""
        self.max_bytes = max_bytes
        self.cond = threading.Condition()  # guards the state below and the store's own
        self.counts: Counter[str] = Counter()
        self.stopping = False
        self._write, self._first, self._idle = write, first, idle
        self._pending: dict[str, Queued] = {}
        self._queue: deque[Queued] = deque()  # its head is written while it stays queued
        self._bytes = 0
        self._busy = True  # the thread is starting (`first`) or writing
        self._name = name
        self._thread: threading.Thread | None = None

    def __contains__(self, key: str) -> bool:
        with self.cond:
            return key in self._pending

    def __len__(self) -> int:
        with self.cond:
            return len(self._pending)

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def add(self, item: Queued, wait: bool = True,
            skip: Callable[[], bool] | None = None) -> bool:
        """Queue the block; False when it is already queued, `skip` (asked with the lock held,
        once there is room) says not to, or the queue is full and not `wait`."""
        with self.cond:
            while self._queue and self._bytes + item.nbytes > self.max_bytes:
                if not wait:
                    return False
                self.cond.wait()
            if (skip is not None and skip()) or item.key in self._pending:
                return False
            self._pending[item.key] = item
            self._queue.append(item)
            self._bytes += item.nbytes
            self.cond.notify_all()
        return True

    def read(self, key: str) -> ReadResult | None:
        """A copy of the block while it is queued (counted as a read), else None."""
        with self.cond:
            item = self._pending.get(key)
            if item is None:
                return None
            self.counts["reads"] += 1
            return ReadResult([(k.clone(), v.clone()) for k, v in item.kv],
                              ReadStatus.HIT, item.tokens)

    def count(self, name: str) -> None:
        with self.cond:
            self.counts[name] += 1

    def flush(self) -> None:
        """Wait until every queued block is written (and `first` is done)."""
        if self._thread is None:
            return
        with self.cond:
            while self._queue or self._busy:
                self.cond.wait()

    def close(self) -> None:
        """Flush, then stop the thread; the queue takes no blocks afterwards."""
        if self._thread is None:
            return
        self.flush()
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self._thread.join()
        self._thread = None

    def _run(self) -> None:
        if self._first is not None:
            self._first()
        while True:
            with self.cond:
                self._busy = False
                self.cond.notify_all()
                while not self._queue and not self.stopping:
                    due = self._idle[0]() if self._idle is not None else None
                    if due is not None and due <= 0:
                        break
                    self.cond.wait(timeout=due)
                if not self._queue and self.stopping:
                    return
                item = self._queue[0] if self._queue else None
                self._busy = item is not None
            if item is None:
                assert self._idle is not None
                self._idle[1]()
                continue
            settle = self._write(item)
            with self.cond:
                if settle is not None:
                    settle()
                self._queue.popleft()
                del self._pending[item.key]
                self._bytes -= item.nbytes
                self.cond.notify_all()
