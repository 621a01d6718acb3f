"""Request queue, cache-aware admission and continuous batched decoding.

`admit_pending()` is where the design document's lookup flow starts: each admitted request calls
`backend.prefill_lookup` and holds its cached blocks until it finishes. Admission is
longest-prefix-match first, and a request that shares an uncached prefix with another request
of the same admission wave waits one wave: the first computes the prefix and stores it right
after its prefill, so the second finds it in the cache instead of computing it again.

Batched decode runs all running sequences in one forward per step over a left-padded
`DynamicCache` with a 2D attention mask and per-row position ids. Why padding and not a paged
attention function reading the pool by block table: on CPU one decode step costs about the same
for 1 or 16 rows (it is bound by reading the weights), so batching is where the time goes, and
padded batches use transformers' own fused SDPA kernel; a Python-level paged attention would pay
a per-layer gather each step for a saving (no duplicated shared prefix) that only matters when
the batch's K/V rivals the weights in size. The dense batch is rebuilt only when rows join
(finished rows idle in place until then, or until half the batch has finished).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvchat.cache.blocks import KV
from kvchat.engine.backend import (
    Backend,
    GenerationResult,
    PrefillLookup,
    Request,
    SequenceState,
    past_kv,
    past_length,
    reserved_past,
)

TextCallback = Callable[["Ticket", str], None]


class RequestCancelled(Exception):
    pass


@dataclass(eq=False)
class Ticket:
    """A submitted request; `result` is set once it has run, `error` if it could not."""

    request_id: int
    request: Request
    on_text: TextCallback | None = None
    cancel_event: threading.Event = field(default_factory=threading.Event)
    state: SequenceState | None = None
    result: GenerationResult | None = None
    error: Exception | None = None
    notified: bool = False  # on_finish has been called for it

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    def cancel(self) -> None:
        """Stop this request at the next step; what it computed is still stored."""
        self.cancel_event.set()


@dataclass(eq=False)
class _Row:
    ticket: Ticket
    state: SequenceState
    kv: list[KV] | None  # compact (1, H, L, D) per layer until merged into the batch
    kv_len: int  # positions with K/V
    alive: bool = True


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    def __init__(
        self,
        backend: Backend,
        batch_size: int = 1,
        on_finish: Callable[[Ticket], None] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.backend = backend
        self.batch_size = batch_size
        self.on_finish = on_finish
        self.pending: list[Ticket] = []
        self.rows: list[_Row] = []  # aligned with the batch dimension of self._past
        self._past: Any = None  # the backend's DynamicCache over all rows, left-padded
        self._mask: torch.Tensor | None = None  # (B, L) bool: which columns hold real K/V
        self._ids = itertools.count()
        self._dirty = False  # rows joined or left since the batch was built
        self.steps = 0  # decode forwards run (one per step, whatever the batch size)

    # ---- queue ------------------------------------------------------------------------------

    def submit(self, request: Request, on_text: TextCallback | None = None) -> Ticket:
        ticket = Ticket(next(self._ids), request, on_text)
        self.pending.append(ticket)
        return ticket

    @property
    def running(self) -> list[Ticket]:
        return [r.ticket for r in self.rows if r.alive]

    @property
    def idle(self) -> bool:
        return not self.pending and not any(r.alive for r in self.rows)

    def run(self) -> None:
        """Drain the queue (new requests may be submitted from callbacks meanwhile)."""
        while not self.idle:
            self.step()

    def step(self) -> None:
        """Admit what fits, then one decode step for every running sequence."""
        self.admit_pending()
        self._decode_step()

    # ---- admission ---------------------------------------------------------------------------

    def _wave(self) -> list[Ticket]:
        cache = self.backend.cache
        room = self.batch_size - sum(r.alive for r in self.rows)
        if room <= 0 or not self.pending:
            return []
        hits = {t: cache.peek(t.request.prompt_ids) if cache else 0 for t in self.pending}
        order = sorted(self.pending, key=lambda t: (-hits[t], t.request_id))
        margin = cache.block_size if cache else 0
        wave: list[Ticket] = []
        for ticket in order:
            if len(wave) >= room:
                break
            prompt = ticket.request.prompt_ids
            if cache is not None and any(
                _common_prefix(prompt, w.request.prompt_ids) > hits[ticket] + margin for w in wave
            ):
                continue  # its prefix is being computed in this wave: take it from the cache next
            wave.append(ticket)
        return wave

    def admit_pending(self) -> list[Ticket]:
        """Look up, prefill and sample the first token of the next wave of requests."""
        wave = self._wave()
        if not wave:
            return []
        for ticket in wave:
            self.pending.remove(ticket)
        for ticket in [t for t in wave if t.cancel_event.is_set()]:
            ticket.error = RequestCancelled("cancelled before it started")
            self._notify(ticket)
            wave.remove(ticket)
        batched: list[tuple[Ticket, SequenceState, PrefillLookup]] = []
        admitted: list[Ticket] = []
        try:
            self._admit_wave(wave, batched, admitted)
        except BaseException:
            self._undo_wave(wave)
            raise
        return admitted

    def _undo_wave(self, wave: list[Ticket]) -> None:
        """After a failure mid-admission: requests that looked up blocks finish as interrupted
        (releasing them); requests that had not started go back to the queue."""
        joined = {id(r.ticket) for r in self.rows}
        for ticket in reversed(wave):
            if ticket.done or id(ticket) in joined:
                continue
            if ticket.state is None:
                self.pending.insert(0, ticket)
                continue
            ticket.state.interrupt()
            ticket.result = ticket.state.finish(None, 0)
            self._notify(ticket)

    def _admit_wave(
        self,
        wave: list[Ticket],
        batched: list[tuple[Ticket, SequenceState, PrefillLookup]],
        admitted: list[Ticket],
    ) -> None:
        b = self.backend
        with torch.inference_mode():
            for ticket in wave:
                try:
                    b.check_request(ticket.request)
                except Exception as exc:  # a bad request must not stop the queue
                    ticket.error = exc
                    self._notify(ticket)
                    continue
                t0 = time.perf_counter()
                pre = b.prefill_lookup(ticket.request.prompt_ids, ticket.request.sid)
                state = SequenceState(b, ticket.request, pre, t0)
                ticket.state = state
                admitted.append(ticket)
                tail = len(ticket.request.prompt_ids) - pre.matched
                exact = pre.lookup is not None and pre.lookup.logits is not None
                if exact or tail > b.prefill_chunk or b.track_attention or len(wave) == 1:
                    self._prefill_alone(ticket, state, pre)
                else:
                    batched.append((ticket, state, pre))
            if batched:
                self._prefill_together(batched)

    def _prefill_alone(self, ticket: Ticket, state: SequenceState, pre: PrefillLookup) -> None:
        b = self.backend
        past = pre.past_key_values or b.empty_past()
        try:
            ok = state.prefill(past, ticket.cancel_event)
        except BaseException:
            state.interrupt()
            self._finish_state(ticket, state, past_kv(past, 0, past_length(past)),
                               past_length(past))
            raise
        kv = past_kv(past, 0, past_length(past))
        if not ok:
            self._finish_state(ticket, state, kv, past_length(past))
            return
        self._after_prefill(ticket, state, kv)

    def _prefill_together(self, group: list[tuple[Ticket, SequenceState, PrefillLookup]]) -> None:
        """One forward for the uncached tails of several prompts: pasts right-aligned in a
        left-padded block, tails left-aligned after it (pad queries then still see real keys,
        so no attention row is fully masked)."""
        b = self.backend
        n_rows = len(group)
        matched = [pre.matched for _, _, pre in group]
        tails = [t.request.prompt_ids[m:] for (t, _, _), m in zip(group, matched, strict=True)]
        p_len, t_len = max(matched), max(len(t) for t in tails)
        pasts = [
            past_kv(pre.past_key_values, 0, pre.matched) if pre.past_key_values else None
            for _, _, pre in group
        ]
        ref = next((p for p in pasts if p is not None), None)
        kv: list[KV] = []
        if ref is not None:
            for layer_idx, (k0, _) in enumerate(ref):
                # room for the tails too: the forward writes them in place
                shape = (n_rows, k0.shape[1], p_len + t_len, k0.shape[3])
                keys, values = k0.new_zeros(shape), k0.new_zeros(shape)
                for i, row_past in enumerate(pasts):
                    if row_past is not None and matched[i]:
                        keys[i, :, p_len - matched[i] : p_len] = row_past[layer_idx][0][0]
                        values[i, :, p_len - matched[i] : p_len] = row_past[layer_idx][1][0]
                kv.append((keys, values))
        mask = torch.zeros(n_rows, p_len + t_len, dtype=torch.long, device=b.device)
        ids = torch.zeros(n_rows, t_len, dtype=torch.long, device=b.device)
        pos = torch.zeros(n_rows, t_len, dtype=torch.long, device=b.device)
        for i, tail in enumerate(tails):
            mask[i, p_len - matched[i] : p_len + len(tail)] = 1
            ids[i, : len(tail)] = torch.tensor(tail, device=b.device)
            pos[i] = torch.arange(matched[i], matched[i] + t_len, device=b.device)
        past = reserved_past(kv, p_len, b.model.config) if kv else b.empty_past()
        last_cols = sorted({len(t) - 1 for t in tails})
        logits_cols, _ = b.forward_batch(ids, past, mask, pos, columns=last_cols)
        full = past_kv(past, 0, p_len + t_len)
        for i, (ticket, state, _) in enumerate(group):
            col = last_cols.index(len(tails[i]) - 1)
            state.prompt_logits = logits_cols[i, col]
            state.t_prefill = time.perf_counter()
            # a row's real positions are one run: its past right-aligned, its tail after it
            lo, hi = p_len - matched[i], p_len + len(tails[i])
            row_kv = [(k[i : i + 1, :, lo:hi], v[i : i + 1, :, lo:hi]) for k, v in full]
            self._after_prefill(ticket, state, row_kv)

    def _after_prefill(self, ticket: Ticket, state: SequenceState, kv: list[KV]) -> None:
        """Store the prompt right away (so the next wave hits it), sample the first token."""
        n = len(ticket.request.prompt_ids)
        state.store_prompt(kv)
        assert state.prompt_logits is not None
        self._emit(ticket, state.push(state.prompt_logits))
        if state.done or ticket.cancel_event.is_set():
            if not state.done:
                state.interrupt()
            self._finish_state(ticket, state, kv, n)
            return
        self.rows.append(_Row(ticket, state, kv, n))
        self._dirty = True

    # ---- decode ------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Pack the live rows into one left-padded batch (rows that joined bring their own K/V)."""
        live = [r for r in self.rows if r.alive]
        b = self.backend
        if not live:
            self.rows, self._past, self._mask = [], None, None
            self._dirty = False
            return
        per_row: list[list[KV]] = []
        for i, row in enumerate(self.rows):
            if not row.alive:
                continue
            if row.kv is not None:
                per_row.append(row.kv)
            else:
                per_row.append(self._row_kv(i, 0, row.kv_len))
        width = max(r.kv_len for r in live)
        # room for every row's remaining tokens, so decode steps write in place
        room = max(r.state.request.params.max_new_tokens - len(r.state.generated) for r in live)
        capacity = width + max(1, min(room, b.max_context - width))
        kv: list[KV] = []
        for layer_idx in range(len(per_row[0])):
            k0 = per_row[0][layer_idx][0]
            shape = (len(live), k0.shape[1], capacity, k0.shape[3])
            keys, values = k0.new_zeros(shape), k0.new_zeros(shape)
            for i, (row, row_kv) in enumerate(zip(live, per_row, strict=True)):
                keys[i, :, width - row.kv_len : width] = row_kv[layer_idx][0][0]
                values[i, :, width - row.kv_len : width] = row_kv[layer_idx][1][0]
            kv.append((keys, values))
        mask = torch.zeros(len(live), width, dtype=torch.bool, device=b.device)
        for i, row in enumerate(live):
            mask[i, width - row.kv_len :] = True
            row.kv = None
        self.rows, self._mask = live, mask
        self._past = reserved_past(kv, width, b.model.config)
        self._dirty = False

    def _row_kv(self, i: int, start: int, end: int) -> list[KV]:
        """Row i's K/V for positions [start, end), out of the padded batch."""
        assert self._past is not None and self._mask is not None
        width = self._mask.shape[1]
        lo = width - self.rows[i].kv_len
        return [
            (k[i : i + 1, :, lo + start : lo + end], v[i : i + 1, :, lo + start : lo + end])
            for k, v in past_kv(self._past, 0, width)
        ]

    def _decode_step(self) -> None:
        dead = sum(not r.alive for r in self.rows)
        if self._dirty or (self.rows and dead * 2 >= len(self.rows)):
            self._rebuild()
        if not any(r.alive for r in self.rows):
            return
        assert self._past is not None and self._mask is not None
        b = self.backend
        dev = b.device
        last = torch.tensor([[r.state.generated[-1]] for r in self.rows], device=dev)
        pos = torch.tensor([[r.kv_len] for r in self.rows], device=dev)
        mask = torch.cat([self._mask, torch.ones(len(self.rows), 1, dtype=torch.bool,
                                                   device=dev)], dim=1)
        with torch.inference_mode():
            logits, mass = b.forward_batch(last, self._past, mask.long(), pos)
        # the forward grew every row by one position: record that for all rows before any
        # per-row work (a callback or Ctrl-C below must not leave rows with stale lengths)
        self._mask = mask
        self.steps += 1
        for row in self.rows:
            row.kv_len += 1
        for i, row in enumerate(self.rows):
            if not row.alive:
                continue
            if mass is not None:
                row.state.add_mass(mass[i][mask[i]])
            self._emit(row.ticket, row.state.push(logits[i]))
            if not row.state.done and row.ticket.cancel_event.is_set():
                row.state.interrupt()
            if row.state.done:
                self._finish_row(i)

    def _finish_row(self, i: int) -> None:
        row = self.rows[i]
        row.alive = False  # first: an interrupt below must not make abort() finish it twice
        matched = row.state.pre.matched
        self._finish_state(row.ticket, row.state, self._row_kv(i, matched, row.kv_len),
                           row.kv_len, sliced=True)

    def _finish_state(
        self,
        ticket: Ticket,
        state: SequenceState,
        kv: Sequence[KV],
        kv_len: int,
        sliced: bool = False,
    ) -> None:
        matched = state.pre.matched
        if not sliced:
            kv = [(k[:, :, matched:kv_len], v[:, :, matched:kv_len]) for k, v in kv]
        try:
            state.finish(list(kv), kv_len)
        finally:  # finish sets a result even when interrupted mid-store: report it, once
            ticket.result = state.result
            self._notify(ticket)

    def _emit(self, ticket: Ticket, delta: str) -> None:
        if delta and ticket.on_text is not None:
            ticket.on_text(ticket, delta)

    def _notify(self, ticket: Ticket) -> None:
        if ticket.notified:
            return
        ticket.notified = True
        if self.on_finish is not None:
            self.on_finish(ticket)

    def abort(self) -> None:
        """Stop everything (Ctrl-C): running requests store what they computed and finish as
        interrupted; pending ones never start."""
        errors: list[BaseException] = []
        for i, row in enumerate(self.rows):
            if not row.alive:
                continue
            row.state.interrupt()
            try:
                if row.kv is not None:
                    row.alive = False
                    self._finish_state(row.ticket, row.state, row.kv, row.kv_len)
                else:
                    self._finish_row(i)
            except BaseException as exc:  # finish the others first, then report
                errors.append(exc)
        self.rows, self._past, self._mask = [], None, None
        self.pending.clear()
        if errors:
            raise errors[0]
