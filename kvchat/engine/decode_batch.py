"""The running sequences' K/V, packed for one batched decode forward per step.

Why padding and not a paged attention function reading the pool by block table: on CPU one
decode step costs about the same for 1 or 16 rows (it is bound by reading the weights), so
batching is where the time goes, and padded batches use transformers' own kernels; a
Python-level paged attention would pay a per-layer gather each step. The one saving it would
bring that matters, a shared prefix not duplicated per row, the batch's head below gives.

Layout: per layer (B, H, capacity, D) buffers, reserved when the batch is built. Rows are
left-padded so that every row's next position is the same column, `width`; a step writes its
columns in place and attention reads the whole buffer under a (B, capacity) column mask. A step
may carry drafts (`step(drafts)`): row i then feeds [last token, draft...] in q columns, and
`settle(i, accepted)` keeps the columns its verification accepted; the rest stay masked, as
holes, until the next rebuild packs the rows again. The dense batch is rebuilt only when rows
join (finished rows idle in place until then, or until half the batch has finished).

    columns  0 ........ width-kv_len ...... width-1 | width ... width+q-1 | ... capacity-1
    row i    padding    its K/V (maybe holes)       | last, d1, ..., dq-1 | unwritten

A head: when every row starts with the same HEAD_MIN or more tokens (a few-shot header, a system
prompt, one prompt sampled many times) and the runner's forward can read it
(`ModelRunner.attends_heads`), their K/V for those P positions are held once, beside the
buffers (`reserved_past(..., head=)`), and the buffers hold each row's positions from P on:
the columns above count from there (kv_len - P of them are the row's). The rows' queries meet
the head in one tall matmul per KV head (`head_attention`), and a rebuild copies each row's own
positions only: 22 few-shot rows after a 455-token header move ~25 MB instead of ~250 MB
(whose fresh pages cost 0.1-0.6 s a rebuild in a profile here). Rows with the same tokens have
the same K/V there, so the head is the first row's. Other forwards keep every row's copy.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any, NamedTuple

import torch

from kvchat.cache.blocks import KV
from kvchat.cache.radix import common_prefix
from kvchat.engine.decode_attention import SMALL_Q
from kvchat.engine.model_runner import ModelRunner
from kvchat.engine.past import Pieces, pack_right_aligned, past_kv, reserve, reserved_past
from kvchat.engine.sequence import Sequence, Status

HEAD_MIN = 64  # shared leading positions held once; fewer are not worth the extra matmuls


class DecodeStep(NamedTuple):
    rows: list[Sequence]  # aligned with the batch dimension
    logits: torch.Tensor  # (B, q, vocab): column j follows input j of the row
    mass: torch.Tensor | None  # (B, capacity) attention mass per key column (H2O), or None


class DecodeBatch:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.rows: list[Sequence] = []  # aligned with the batch dimension of the past
        self._joining: list[Sequence] = []  # bring their own compact K/V (seq.kv)
        self._past: Any = None
        self._mask: torch.Tensor | None = None  # (B, capacity) bool: which columns are real
        self._width = 0  # columns written so far; every row's next position is this column
        self._q = 1  # columns the last step wrote per row
        self._head: list[KV] | None = None  # per layer (1, H, P, D): every row's first P
        self._head_len = 0  # P (0: no head; the columns hold every position)

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

    def _columns(self, i: int) -> torch.Tensor:
        """Row i's real columns, in position order."""
        assert self._mask is not None
        return self._mask[i, : self._width].nonzero().squeeze(1)

    def kv_of(self, seq: Sequence, start: int, end: int) -> list[KV]:
        """The sequence's K/V for positions [start, end), wherever it lives now: views, unless
        the range spans the head and the row's columns, or rejected drafts left holes among
        those (then a copy)."""
        if seq.kv is not None:
            return seq.kv.range(start, end)
        assert self._past is not None and self._mask is not None
        i, p = self.rows.index(seq), self._head_len
        runs = []
        if start < p and self._head is not None:
            runs.append([(k[:, :, start : min(end, p)], v[:, :, start : min(end, p)])
                         for k, v in self._head])
        if end > p or not runs:
            runs.append(self._own(i, max(start, p) - p, max(end, p) - p))
        return Pieces(*runs).range(0, end - start)

    def _own(self, i: int, start: int, end: int) -> list[KV]:
        """Row i's K/V in its own columns, for its positions [P + start, P + end)."""
        assert self._past is not None and self._mask is not None
        layers = past_kv(self._past, 0, self._width)
        lo = self._width - (self.rows[i].kv_len - self._head_len)
        if bool(self._mask[i, lo : self._width].all()):  # no holes: one run of columns
            return [(k[i : i + 1, :, lo + start : lo + end], v[i : i + 1, :, lo + start : lo + end])
                    for k, v in layers]
        cols = self._columns(i)[start:end]
        return [(k[i : i + 1].index_select(2, cols), v[i : i + 1].index_select(2, cols))
                for k, v in layers]

    def _head_length(self, live: list[Sequence]) -> int:
        """How many leading positions every live row shares (the same tokens: the same K/V),
        if the runner can hold them once, the rows are of one namespace (what one tenant sent
        never shapes another's batch) and the positions are worth it; else 0."""
        if len(live) < 2 or not self.runner.attends_heads \
                or len({s.request.namespace for s in live}) > 1:
            return 0
        first = live[0].tokens()
        shared = min(s.kv_len for s in live)
        for seq in live[1:]:
            shared = common_prefix(seq.tokens()[:shared], first)
            if shared < HEAD_MIN:
                return 0
        return shared

    def draft_limit(self, wanted: int) -> int:
        """Draft tokens a row may carry next step: `wanted`, or fewer with a head, which only
        the fused forward reads and it takes at most SMALL_Q queries a row."""
        return min(wanted, SMALL_Q - 1) if self._head is not None else wanted

    def _rebuild(self) -> None:
        live = self.live
        if not live:
            self.rows, self._joining, self._past, self._mask = [], [], None, None
            self._head, self._head_len = None, 0
            return
        p = self._head_length(live)
        # a copy, so that no old buffer stays alive for its sake
        head = [(k.clone(), v.clone()) for k, v in self.kv_of(live[0], 0, p)] if p else None
        per_row = [self.kv_of(s, p, s.kv_len) for s in live]
        own = [s.kv_len - p for s in live]
        width = max(own)
        # room for every row's remaining tokens, so decode steps write in place
        room = max(s.params.max_new_tokens - len(s.generated) for s in live)
        capacity = width + max(1, min(room, self.runner.max_context - p - width))
        buffers = pack_right_aligned(per_row, own, width, capacity, like=per_row[0])
        mask = torch.zeros(len(live), capacity, dtype=torch.bool, device=self.runner.device)
        for i, n in enumerate(own):
            mask[i, width - n : width] = True
        past = reserved_past(buffers, width, self.runner.config, head)
        # the new batch replaces the old in one statement (an interrupt before it leaves the
        # old one whole, and kv_of reads either), then the rows let go of their own K/V
        self.rows, self._joining, self._mask, self._width, self._head, self._head_len, \
            self._past = live, [], mask, width, head, p, past
        for seq in live:
            seq.kv = None  # from now on its K/V live in the batch

    def prepare(self) -> list[Sequence]:
        """The rows of the next step (rebuilding the batch first if rows joined or half of it
        finished); a draft for the step is given per row, in this order."""
        dead = sum(s.status is not Status.RUNNING for s in self.rows)
        if self._joining or (self.rows and dead * 2 >= len(self.rows)):
            self._rebuild()
        return self.rows

    def step(self, drafts: Seq[Seq[int]] = ()) -> DecodeStep:
        """One forward over every row of `prepare()`: its last token, then its draft (if any)
        to verify. Every row's length grows by one; `settle` adds the draft tokens a row
        accepted."""
        self.prepare()
        assert self._past is not None and self._mask is not None
        dev, rows, width = self.runner.device, self.rows, self._width
        drafts = drafts or [()] * len(rows)
        q = 1 + max(map(len, drafts))
        if width + q > self._mask.shape[1]:  # out of room: double, amortised like a list
            grow = max(q, self._mask.shape[1])
            reserve(self._past, grow)
            self._mask = torch.cat([self._mask, self._mask.new_zeros(len(rows), grow)], dim=1)
        ids = torch.tensor([[s.generated[-1], *d, *[s.generated[-1]] * (q - 1 - len(d))]
                            for s, d in zip(rows, drafts, strict=True)], device=dev)
        pos = torch.tensor([s.kv_len for s in rows], device=dev)[:, None] \
            + torch.arange(q, device=dev)
        for i, d in enumerate(drafts):  # a row's drafts see each other; padding is never seen
            self._mask[i, width : width + 1 + len(d)] = True
        columns = list(range(q)) if q > 1 else None
        logits, mass = self.runner.forward(ids, self._past, self._mask, pos, columns=columns)
        # the forward wrote q columns in every row: record that for all rows before any
        # per-row work (a callback or Ctrl-C after this must not leave rows with stale lengths);
        # draft columns count once `settle` accepts them
        self._width, self._q = width + q, q
        self._mask[:, width + 1 : width + q] = False
        for seq in rows:
            seq.kv_len += 1
        return DecodeStep(rows, logits if columns else logits[:, None], mass)

    def settle(self, i: int, accepted: int) -> None:
        """Row i's verification accepted its first `accepted` draft tokens: their columns (the
        ones after the row's last token) hold real K/V."""
        if accepted:
            assert self._mask is not None
            start = self._width - self._q + 1
            self._mask[i, start : start + accepted] = True
            self.rows[i].kv_len += accepted

    def real_columns(self, i: int, width: int) -> torch.Tensor:
        """Row i's mask over the first `width` columns (what attention read: the written ones
        for one row, the whole buffer for a batch)."""
        assert self._mask is not None
        return self._mask[i, :width]
