"""The running sequences' K/V, packed for one batched decode forward per step.

Why padding and not a paged attention function reading the pool by block table: on CPU one
decode step costs about the same for 1 or 16 rows (it is bound by reading the weights), so
batching is where the time goes, and padded batches use transformers' own fused SDPA kernel; a
Python-level paged attention would pay a per-layer gather each step for a saving (no duplicated
shared prefix) that only matters when the batch's K/V rivals the weights in size.

Layout: rows left-padded to a common width, so every row's next position is the same column,
written in place into reserved buffers. The dense batch is rebuilt only when rows join
(finished rows idle in place until then, or until half the batch has finished).
"""

from __future__ import annotations

from typing import Any

import torch

from kvchat.cache.blocks import KV
from kvchat.engine.model_runner import ModelRunner
from kvchat.engine.past import pack_right_aligned, past_kv, reserved_past
from kvchat.engine.sequence import Sequence, Status


class DecodeBatch:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.rows: list[Sequence] = []  # aligned with the batch dimension of the past
        self._joining: list[Sequence] = []  # bring their own compact K/V (seq.kv)
        self._past: Any = None
        self._mask: torch.Tensor | None = None  # (B, L) bool: which columns hold real K/V

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.rows + self._joining if s.status is Status.RUNNING]

    def join(self, seq: Sequence) -> None:
        """Add a prefilled sequence whose K/V for [0, seq.kv_len) are in seq.kv."""
        self._joining.append(seq)

    def leave(self, seq: Sequence) -> None:
        """A finished sequence: its row idles until the next rebuild."""
        if seq in self._joining:
            self._joining.remove(seq)

    def kv_of(self, seq: Sequence, start: int, end: int) -> list[KV]:
        """The sequence's K/V for positions [start, end), wherever it lives now."""
        if seq.kv is not None:
            return [(k[:, :, start:end], v[:, :, start:end]) for k, v in seq.kv]
        assert self._past is not None and self._mask is not None
        i = self.rows.index(seq)
        width = self._mask.shape[1]
        lo = width - seq.kv_len
        return [
            (k[i : i + 1, :, lo + start : lo + end], v[i : i + 1, :, lo + start : lo + end])
            for k, v in past_kv(self._past, 0, width)
        ]

    def _rebuild(self) -> None:
        live = self.live
        if not live:
            self.rows, self._joining, self._past, self._mask = [], [], None, None
            return
        per_row = [self.kv_of(s, 0, s.kv_len) for s in live]
        width = max(s.kv_len for s in live)
        # room for every row's remaining tokens, so decode steps write in place
        room = max(s.params.max_new_tokens - len(s.generated) for s in live)
        capacity = width + max(1, min(room, self.runner.max_context - width))
        buffers = pack_right_aligned(per_row, [s.kv_len for s in live], width, capacity,
                                     like=per_row[0])
        mask = torch.zeros(len(live), width, dtype=torch.bool, device=self.runner.device)
        for i, seq in enumerate(live):
            mask[i, width - seq.kv_len :] = True
            seq.kv = None  # from now on its K/V live in the batch
        self.rows, self._joining, self._mask = live, [], mask
        self._past = reserved_past(buffers, width, self.runner.config)

    def step(self) -> tuple[list[Sequence], torch.Tensor, torch.Tensor | None]:
        """One decode forward over every row; returns (rows, logits (B, vocab), attention
        mass per row over its real columns (B, K) or None). Every row's length grows by one."""
        dead = sum(s.status is not Status.RUNNING for s in self.rows)
        if self._joining or (self.rows and dead * 2 >= len(self.rows)):
            self._rebuild()
        assert self._past is not None and self._mask is not None
        dev = self.runner.device
        last = torch.tensor([[s.generated[-1]] for s in self.rows], device=dev)
        pos = torch.tensor([[s.kv_len] for s in self.rows], device=dev)
        ones = torch.ones(len(self.rows), 1, dtype=torch.bool, device=dev)
        mask = torch.cat([self._mask, ones], dim=1)
        logits, mass = self.runner.forward(last, self._past, mask.long(), pos)
        # the forward grew every row by one position: record that for all rows before any
        # per-row work (a callback or Ctrl-C after this must not leave rows with stale lengths)
        self._mask = mask
        for seq in self.rows:
            seq.kv_len += 1
        return self.rows, logits, mass

    def real_columns(self, i: int) -> torch.Tensor:
        assert self._mask is not None
        return self._mask[i]
