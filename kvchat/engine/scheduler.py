"""The scheduler decides what runs in a step; it runs nothing itself.

Admission is cache-aware: longest cached prefix first. A request that shares an uncached prefix
with a request of the same admission wave may wait one wave instead: the first computes the
prefix and stores it right after its prefill, so the second finds it in the cache. Waiting
leaves its row idle for one decode step, which costs its share of that step (the step costs
about the same for any number of rows); it is worth it when the prefix it would not compute
takes longer to prefill (`StepCosts`, measured as the engine runs), whatever the block size.
An exact repeat of a wave-mate always waits: it then needs no forward at all (the first one's
stored logits give its first token). A greedy request identical to one still decoding (same
prompt, same namespace, both greedy; the engine names those it can draft from) waits until that
one finishes: its reply is then in the cache, replayed with no forward where it reaches the
repeat's stop (`engine/replay.py`) and else decoded as drafts, several tokens per forward,
instead of taking a row of its own to compute the same tokens alongside. Admitted prompts are
prefilled one by one (long tails, exact hits, H2O, a wave of one) or together in one forward
(short tails of similar length).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import NamedTuple

from kvchat.cache.radix import common_prefix
from kvchat.engine.sequence import Sequence

# cached prefix length of a prompt in a namespace, without touching the cache
Peek = Callable[[Seq[int], str], int]


class Plan(NamedTuple):
    admit: list[Sequence]  # look up and prefill these now
    cancelled: list[Sequence]  # cancelled while waiting: finish them without running


class StepCosts:
    """Running estimates (exponential averages) of one decode step and one prefilled prompt
    token on this model and device: what admission weighs a wait against."""

    SMOOTHING = 0.3

    def __init__(self) -> None:
        self.decode_s: float | None = None
        self.prefill_token_s: float | None = None

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.SMOOTHING * (new - old)

    def decode(self, seconds: float) -> None:
        self.decode_s = self._average(self.decode_s, seconds)

    def prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_token_s = self._average(self.prefill_token_s, seconds / tokens)

    @property
    def wait_tokens(self) -> float:
        """Prompt tokens whose prefill costs as much as one decode step; 0 before anything was
        measured (then any shared uncached prefix is waited for)."""
        if self.decode_s is None or not self.prefill_token_s:
            return 0.0
        return self.decode_s / self.prefill_token_s


class PrefillPlan(NamedTuple):
    alone: list[Sequence]
    together: list[list[Sequence]]  # groups, each prefilled in one padded forward


class Scheduler:
    def __init__(self, batch_size: int, prefill_chunk: int, peek: Peek | None = None) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.batch_size = batch_size
        self.prefill_chunk = prefill_chunk
        self.peek = peek
        self.costs = StepCosts()
        self.waiting: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> bool:
        if seq in self.waiting:
            self.waiting.remove(seq)
            return True
        return False

    def schedule(self, running: int, decoding: Seq[Sequence] = ()) -> Plan:
        """The next admission wave, given how many sequences are running; `decoding`: those
        whose reply a waiting repeat would draft (none when the engine cannot draft)."""
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
        leaders = {s.prompt_key for s in decoding if s.params.greedy}
        wave: list[Sequence] = []
        for seq in order:
            if len(wave) >= room:
                break
            if leaders and seq.params.greedy and seq.prompt_key in leaders:
                continue  # the same greedy request is decoding: draft its reply once it is done
            if peek is not None and self._waits(seq, wave, hits[seq.seq_id], running):
                continue  # its prefix is being computed in this wave: take it from the cache next
            wave.append(seq)
        for seq in wave:
            self.waiting.remove(seq)
        return Plan(wave, cancelled)

    def _waits(self, seq: Sequence, wave: list[Sequence], hit: int, running: int) -> bool:
        """Whether `seq` gains more by waiting for a wave-mate's prefix than its idle row's
        share of a decode step costs."""
        n = len(seq.prompt_ids)
        worth = self.costs.wait_tokens / (running + len(wave) + 1)
        for mate in wave:
            if mate.request.namespace != seq.request.namespace:
                continue
            shared = common_prefix(seq.prompt_ids, mate.prompt_ids)
            if shared == n == len(mate.prompt_ids):
                return True  # an exact repeat: answered from the mate's stored logits
            # a non-exact hit leaves the last prompt token to compute
            if min(shared, n - 1) - hit > worth:
                return True
        return False

    def prefill_plan(self, wave: list[Sequence], track_mass: bool) -> PrefillPlan:
        """Which looked-up prompts prefill on their own and which share one forward: short
        tails of similar length, so that padding at most doubles the rows a group computes (on
        CPU a forward's cost grows with its rows; one 130-token tail among 18-token ones would
        pad them all to 130)."""
        alone: list[Sequence] = []
        short: list[tuple[int, Sequence]] = []  # (uncached tokens, sequence): those that may share
        for seq in wave:
            tail = len(seq.prompt_ids) - seq.matched
            if seq.exact or tail > self.prefill_chunk or track_mass or len(wave) == 1:
                alone.append(seq)
            else:
                short.append((tail, seq))
        groups: list[list[Sequence]] = []
        group: list[Sequence] = []
        real = 0
        for tail, seq in sorted(short, key=lambda pair: pair[0]):
            if group and (len(group) + 1) * tail > 2 * (real + tail):
                groups.append(group)
                group, real = [], 0
            group.append(seq)
            real += tail
        if group:
            groups.append(group)
        alone += [g[0] for g in groups if len(g) == 1]
        return PrefillPlan(alone, [g for g in groups if len(g) > 1])
