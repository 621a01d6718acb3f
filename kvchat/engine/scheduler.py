"""The scheduler decides what runs in a step; it runs nothing itself.

Admission is cache-aware: longest cached prefix first. A request that shares an uncached prefix
with another request of the same admission wave waits one wave: the first computes the prefix and
stores it right after its prefill, so the second finds it in the cache instead of computing it.
Admitted prompts are then prefilled one by one (long tails, exact hits, H2O, a wave of one) or
together in one padded forward (short tails of several prompts).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import NamedTuple

from kvchat.engine.sequence import Sequence

# cached prefix length of a prompt in a namespace, without touching the cache
Peek = Callable[[Seq[int], str], int]


class Plan(NamedTuple):
    admit: list[Sequence]  # look up and prefill these now
    cancelled: list[Sequence]  # cancelled while waiting: finish them without running


class PrefillPlan(NamedTuple):
    alone: list[Sequence]
    together: list[Sequence]


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    def __init__(self, batch_size: int, prefill_chunk: int, peek: Peek | None = None,
                 block_size: int = 0) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.batch_size = batch_size
        self.prefill_chunk = prefill_chunk
        self.peek = peek
        self.margin = block_size  # a shared prefix must beat the hit by a block to wait for it
        self.waiting: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> bool:
        if seq in self.waiting:
            self.waiting.remove(seq)
            return True
        return False

    def schedule(self, running: int) -> Plan:
        """The next admission wave, given how many sequences are running."""
        cancelled = [s for s in self.waiting if s.cancel_event.is_set()]
        for seq in cancelled:
            self.waiting.remove(seq)
        room = self.batch_size - running
        if room <= 0 or not self.waiting:
            return Plan([], cancelled)
        peek = self.peek
        hits = {s.seq_id: peek(s.prompt_ids, s.request.namespace) if peek else 0
                for s in self.waiting}
        order = sorted(self.waiting, key=lambda s: (-hits[s.seq_id], s.seq_id))
        wave: list[Sequence] = []
        for seq in order:
            if len(wave) >= room:
                break
            if peek is not None and any(
                w.request.namespace == seq.request.namespace
                and common_prefix(seq.prompt_ids, w.prompt_ids) > hits[seq.seq_id] + self.margin
                for w in wave
            ):
                continue  # its prefix is being computed in this wave: take it from the cache next
            wave.append(seq)
        for seq in wave:
            self.waiting.remove(seq)
        return Plan(wave, cancelled)

    def prefill_plan(self, wave: list[Sequence], track_mass: bool) -> PrefillPlan:
        """Which looked-up prompts prefill on their own and which share one forward."""
        alone, together = [], []
        for seq in wave:
            tail = len(seq.prompt_ids) - seq.matched
            if seq.exact or tail > self.prefill_chunk or track_mass or len(wave) == 1:
                alone.append(seq)
            else:
                together.append(seq)
        if len(together) == 1:
            alone += together
            together = []
        return PrefillPlan(alone, together)
