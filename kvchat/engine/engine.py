"""The Engine: every request, from every front end, goes through `step()`.

    step():  plan = scheduler.schedule()      which waiting sequences join now
             admit(plan)                       lookup -> prefill -> store prompt -> first token
             decode()                          one batched forward -> sample -> finish the done

A sequence's K/V is stored in one place (`_commit`) and its blocks are released in one place
(`_finish`). Callers submit a `Request` and get a `RequestHandle` (`engine/handle.py`): iterate
it to drive the engine from the calling thread (the REPL, batch, verify), or pass a listener
and let another thread step (the server).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from typing import Any

import torch

from kvchat.cache.kvcache import PagedKVCache
from kvchat.cache.radix import common_prefix
from kvchat.config import CacheConfig, SamplingParams
from kvchat.engine.codec import ChatCodec
from kvchat.engine.decode_batch import DecodeBatch
from kvchat.engine.drafting import DRAFT_MAX, plan_drafts
from kvchat.engine.handle import Listener, PromptTooLongError, RequestCancelled, RequestHandle
from kvchat.engine.model_runner import ModelRunner
from kvchat.engine.past import Pieces, kv_shape, layer_devices, past_kv, past_length
from kvchat.engine.replay import remember_reply, replayable
from kvchat.engine.scheduler import Scheduler
from kvchat.engine.sequence import (
    Finished,
    GenerationResult,
    Request,
    Sequence,
    Status,
    TextDelta,
)
from kvchat.errors import KvchatError

log = logging.getLogger("kvchat.engine")


class Engine:
    def __init__(self, runner: ModelRunner, codec: ChatCodec, cache: PagedKVCache | None,
                 batch_size: int = 8) -> None:
        self.runner = runner
        self.codec = codec
        self.cache = cache
        peek = cache.peek if cache is not None else None
        self.scheduler = Scheduler(batch_size, runner.prefill_chunk, peek)
        self.batch = DecodeBatch(runner)
        self.steps = 0  # decode forwards run (one per step, whatever the batch size)
        self._ids = itertools.count()
        self._admitting: list[Sequence] = []  # looked up this step, not yet in the batch
        self.draft_max = DRAFT_MAX  # draft tokens per row and step; 0: no drafting
        self.replay = True  # exact greedy repeats may end on a stored reply (engine/replay.py)

    @classmethod
    def create(cls, model: Any, tokenizer: Any, cache_config: CacheConfig | None,
               batch_size: int = 8, prefill_chunk: int = 512) -> Engine:
        """An engine with a fresh pool sized by cache_config (None: no cache at all)."""
        if prefill_chunk < 1:
            raise KvchatError(f"--prefill-chunk must be at least 1, got {prefill_chunk}.")
        cache = None
        if cache_config is not None:
            n_layers, kv_heads, head_dim = kv_shape(model.config)
            dtype = next(model.parameters()).dtype
            cache = PagedKVCache.create(cache_config, n_layers, kv_heads, head_dim, dtype,
                                        layer_devices(model, n_layers))
        runner = ModelRunner(model, prefill_chunk, None if cache is None else cache.policy.name)
        return cls(runner, ChatCodec(tokenizer, model), cache, batch_size)

    def warm_up(self) -> None:
        """Run the first decode steps of a batch of one and of two (no cache touched): the
        first call of a compiled step compiles it."""
        scratch = Engine(self.runner, self.codec, None, 2)
        ids = [0] * 4
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)
        scratch.generate(Request(ids, params))
        pair = [scratch.submit(Request(ids, params)), scratch.submit(Request(ids[:3], params))]
        while any(not h.done for h in pair):
            scratch.step()

    def without_cache(self) -> Engine:
        """Same model, no cache (so no drafts either): the cold reference for verify and
        benchmarks."""
        runner = ModelRunner(self.runner.model, self.runner.prefill_chunk)
        return Engine(runner, self.codec, None, self.batch_size)

    # ---- facts ----

    @property
    def batch_size(self) -> int:
        return self.scheduler.batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        if value < 1:
            raise KvchatError(f"The batch size must be at least 1, got {value}.")
        self.scheduler.batch_size = value

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def max_context(self) -> int:
        return self.runner.max_context

    @property
    def drafting(self) -> bool:
        """Whether decode steps may carry drafts: with a cache, drafting on, and not under H2O
        (which counts the attention every column receives)."""
        return self.cache is not None and self.draft_max > 0 and self.runner.plan.drafts

    @property
    def running(self) -> int:
        return len(self.batch.live) + len(self._admitting)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def idle(self) -> bool:
        return not self.scheduler.waiting and not self.running

    # ---- requests ----

    def check_request(self, request: Request) -> None:
        n = len(request.prompt_ids)
        if n == 0:
            raise KvchatError("The prompt is empty.")
        if n >= self.max_context:
            raise PromptTooLongError(
                f"The prompt has {n} tokens; the model's context is {self.max_context} tokens."
            )

    def submit(self, request: Request, listener: Listener | None = None) -> RequestHandle:
        """Queue a request (raises KvchatError at once if it cannot run)."""
        self.check_request(request)
        handle = RequestHandle(self, next(self._ids), request, listener)
        self.scheduler.add(handle.seq)
        return handle

    def generate(self, request: Request) -> GenerationResult:
        return self.submit(request).run()

    def interrupt(self, seq: Sequence) -> None:
        """Finish one sequence now: waiting ones never start, running ones keep their K/V."""
        if self.scheduler.remove(seq):
            self._fail(seq, RequestCancelled("The request was cancelled before it started."))
        elif seq.status is Status.RUNNING:
            seq.stop("interrupted")
            self._finish(seq)

    def abort(self) -> None:
        """Stop everything: running sequences finish as interrupted (their K/V cached), waiting
        ones finish with RequestCancelled."""
        for seq in list(self.scheduler.waiting):
            self.interrupt(seq)
        self._stop_running("interrupted")

    # ---- the step ----

    def step(self) -> None:
        """Admit what fits, then one decode step for every running sequence. A failure fails
        the sequences it touched and nothing else; an interrupt (Ctrl-C) finishes the running
        sequences as interrupted, with their K/V cached, and propagates."""
        try:
            # a waiting repeat follows its twin only if it will draft the twin's reply
            decoding = self.batch.live + self._admitting if self.drafting else []
            plan = self.scheduler.schedule(self.running, decoding)
            for seq in plan.cancelled:
                self._fail(seq, RequestCancelled("The request was cancelled before it started."))
            if plan.admit:
                self._admit(plan.admit)
            if self.batch.live:
                self._decode()
        except Exception as exc:
            log.exception("An engine step failed; failing the sequences it was running.")
            self._stop_running("error", exc)
        except BaseException:
            self._stop_running("interrupted")
            raise

    def _admit(self, wave: list[Sequence]) -> None:
        cache = self.cache
        for seq in wave:
            seq.status, seq.t0 = Status.RUNNING, time.perf_counter()
            self._admitting.append(seq)
            if cache is not None:
                seq.lookup = cache.lookup(seq.prompt_ids, seq.request.sid,
                                          seq.request.namespace)
                seq.stored = seq.kv_len = seq.lookup.matched
            if self.runner.track_mass:
                seq.mass = torch.zeros(0, device=self.device)
        plan = self.scheduler.prefill_plan(wave, self.runner.track_mass)
        with torch.inference_mode():
            for seq in plan.alone:
                with self._contained([seq]):
                    self._prefill_alone(seq)
            for group in plan.together:
                with self._contained(group):
                    self._prefill_together(group)

    @contextmanager
    def _contained(self, seqs: list[Sequence]) -> Iterator[None]:
        """A failure in this unit of admission work fails its own sequences and no others."""
        try:
            yield
        except Exception as exc:
            log.exception("Admitting request(s) %s failed.", [s.seq_id for s in seqs])
            for seq in seqs:
                seq.stop("error")
                self._finish(seq, exc)

    def _gather(self, seq: Sequence) -> list[Any] | None:
        if self.cache is None or seq.lookup is None or not seq.matched:
            return None
        return self.cache.gather(seq.lookup.blocks, seq.matched)

    def _prefill_alone(self, seq: Sequence) -> None:
        if seq.exact:  # a repeat: the first token comes from stored logits, K/V only if needed
            assert seq.lookup is not None
            seq.prompt_logits, seq.t_prefill = seq.lookup.logits, time.perf_counter()
            if not self._replay(seq):
                self._first_token(seq)
            return
        past = self.runner.past(self._gather(seq))
        started = time.perf_counter()
        try:
            seq.prompt_logits = self.runner.prefill(
                seq.prompt_ids, seq.matched, past, seq.check_cancel, seq.add_mass)
        finally:  # whole chunks stay usable even if a chunk was interrupted
            seq.kv_len = past_length(past)
            seq.kv = Pieces(past_kv(past, 0, seq.kv_len))
        if seq.prompt_logits is None:
            self._finish(seq)
            return
        seq.t_prefill = time.perf_counter()
        self.scheduler.costs.prefill(len(seq.prompt_ids) - seq.matched, seq.t_prefill - started)
        self._first_token(seq)

    def _prefill_together(self, group: list[Sequence]) -> None:
        shared = self._shared_prefix(group)
        started = time.perf_counter()
        if shared:  # one cached past for all: it goes into the forward once
            assert self.cache is not None and group[0].lookup is not None
            tails = [s.prompt_ids[shared:] for s in group]
            past = self.cache.gather(group[0].lookup.blocks, shared)
            done = self.runner.prefill_shared(tails, past, shared)
        else:
            tails = [s.prompt_ids[s.matched :] for s in group]
            pasts = [self._gather(s) for s in group]
            done = self.runner.prefill_packed(tails, pasts, [s.matched for s in group])
        now = time.perf_counter()
        self.scheduler.costs.prefill(sum(map(len, tails)), now - started)
        for seq, pre in zip(group, done, strict=True):
            seq.prompt_logits, seq.kv, seq.kv_len = pre.logits, pre.kv, pre.kv_len
            seq.t_prefill = now
        for seq in group:
            self._first_token(seq)

    def _shared_prefix(self, group: list[Sequence]) -> int:
        """The length of the cached past every sequence of `group` starts with: the tokens all
        their prompts share, no longer than any one's cached match, whose whole blocks are the
        same blocks for all (its K/V are read from the first sequence's); or 0. Up to a block
        of tokens past it that some of them had cached (through a sibling's blocks) are
        computed again: the forward then carries one past instead of one per row. More than
        that (conversations that share only a system prompt) is not worth it."""
        if self.cache is None or not self.runner.masks_by_position:
            return 0
        first = group[0]
        shared = min(s.matched for s in group)
        for seq in group[1:]:
            shared = common_prefix(seq.prompt_ids[:shared], first.prompt_ids)
        if shared == 0 or any(s.matched - shared > self.cache.block_size for s in group):
            return 0
        full = shared // self.cache.block_size
        assert first.lookup is not None
        ids = [b.block_id for b in first.lookup.blocks[:full]]
        for seq in group[1:]:
            assert seq.lookup is not None
            if [b.block_id for b in seq.lookup.blocks[:full]] != ids:
                return 0
        return shared

    def _first_token(self, seq: Sequence) -> None:
        """Store the prompt right away (so the next wave hits it), then sample from it."""
        self._commit(seq)
        assert seq.prompt_logits is not None
        if not self._push(seq, seq.prompt_logits):
            return
        if seq.done or seq.check_cancel():
            self._finish(seq)
            return
        if seq.kv is None:  # a deferred exact hit needs its K/V from the second token on
            seq.kv = Pieces(self._gather(seq) or [])
            seq.kv_len = seq.matched
        self._admitting.remove(seq)
        self.batch.join(seq)

    def _replay(self, seq: Sequence) -> bool:
        """An exact repeat whose stored greedy reply reaches a stop takes its tokens and ends
        here, with no forward (`engine/replay.py`); False when it must decode."""
        assert seq.lookup is not None
        if not (self.replay and self.runner.invariant) \
                or not replayable(seq, self.codec.eos_ids, self.max_context):
            return False
        for tok in seq.lookup.reply:
            seq.replayed += 1
            if not self._push(seq, tok):
                return True
            if seq.done or seq.check_cancel():
                break
        self._finish(seq)
        return True

    def _decode(self) -> None:
        started = time.perf_counter()
        with torch.inference_mode():  # the batch's tensors are inference tensors, settle too
            drafts: list[list[int]] = []
            if self.drafting:
                assert self.cache is not None
                rows = self.batch.prepare()  # first: it may rebuild the batch, with a head
                drafts = plan_drafts(rows, self.cache, self.batch.draft_limit(self.draft_max))
            step = self.batch.step(drafts)
            self.scheduler.costs.decode(time.perf_counter() - started)
            self.steps += 1
            for i, seq in enumerate(step.rows):
                if seq.status is not Status.RUNNING:
                    continue
                seq.decode_forwards += 1
                if step.mass is not None:
                    row = step.mass[i]
                    seq.add_mass(row[self.batch.real_columns(i, row.shape[0])])
                if self._verify(i, seq, step.logits[i], drafts[i] if drafts else ()) \
                        and (seq.done or seq.check_cancel()):
                    self._finish(seq)

    def _verify(self, i: int, seq: Sequence, logits: torch.Tensor, draft: Seq[int]) -> bool:
        """Push the token after the row's last one, then, while it equals the next draft token,
        the token the forward computed after that one (greedy: exactly the tokens decoding one
        at a time would give). False if pushing failed the sequence."""
        accepted = 0
        ok = self._push(seq, logits[0])
        while ok and accepted < len(draft) and not (seq.done or seq.check_cancel()) \
                and seq.generated[-1] == draft[accepted]:
            accepted += 1
            ok = self._push(seq, logits[accepted])
        if ok:
            self.batch.settle(i, accepted)
        seq.draft_tokens += len(draft)
        seq.draft_accepted += accepted
        return ok

    def _push(self, seq: Sequence, logits: torch.Tensor | int) -> bool:
        """Sample one token (or take a replayed one) and emit its text; a failure here fails
        only this sequence."""
        try:
            codec = self.codec
            delta = seq.take(logits, codec.decode, codec.eos_ids, self.max_context) \
                if isinstance(logits, int) else \
                seq.push(logits, codec.decode, codec.eos_ids, self.max_context)
            if delta:
                seq.emit(TextDelta(delta))
        except Exception as exc:
            seq.stop("error")
            self._finish(seq, exc)
            return False
        return True

    # ---- the end of a sequence ----

    def _commit(self, seq: Sequence, final: bool = False) -> None:
        """Cache every position of `seq` whose K/V exists and is not cached yet: the one place
        a sequence's tokens are stored (after its prefill, and when it finishes)."""
        cache = self.cache
        if cache is None or seq.lookup is None or seq.kv_len <= seq.stored:
            return
        n = len(seq.prompt_ids)
        logits = seq.prompt_logits
        res = cache.write_kv(
            seq.tokens()[: seq.kv_len],
            self.batch.kv_of(seq, seq.matched, seq.kv_len),
            seq.matched,
            logits=None if logits is None or seq.kv_len < n else logits.detach().clone(),
            logits_len=n,
            sid=seq.request.sid,
            namespace=seq.request.namespace,
        )
        seq.stored = max(seq.stored, res.stored)
        if final and seq.mass is not None and seq.mass.numel():
            _record_mass(cache, res.blocks, seq.mass)

    def _finish(self, seq: Sequence, error: Exception | None = None) -> None:
        """Store what the sequence computed, release its blocks, report its result. Runs once;
        the result is set even if an interrupt lands in the store (which then keeps nothing)."""
        if seq.status is Status.FINISHED:
            return
        was_waiting = seq.status is Status.WAITING
        seq.status = Status.FINISHED  # first: an interrupt below must not finish it twice
        try:
            if not was_waiting:
                self._commit(seq, final=True)
                if error is None and self.cache is not None and self.runner.invariant:
                    remember_reply(self.cache, seq)
        finally:
            if self.cache is not None and seq.lookup is not None:
                self.cache.release(seq.lookup.blocks)
            if seq in self._admitting:
                self._admitting.remove(seq)
            self.batch.leave(seq)
            seq.kv = None
            seq.error = error
            seq.result = None if was_waiting else seq.result_of(self.codec.decode, seq.stored)
            if seq.unsent():  # held back as a possible stop string, then interrupted
                seq.emit(TextDelta(seq.unsent()))
            seq.emit(Finished(seq.result, error))

    def _fail(self, seq: Sequence, error: Exception) -> None:
        self._finish(seq, error)

    def _stop_running(self, reason: str, error: Exception | None = None) -> None:
        errors: list[BaseException] = []
        for seq in self._admitting + self.batch.live:
            seq.stop(reason)
            try:
                self._finish(seq, error)
            except BaseException as exc:  # finish the others first, then report
                errors.append(exc)
        if errors:
            raise errors[0]


def _record_mass(cache: PagedKVCache, blocks: Any, mass: torch.Tensor) -> None:
    """Sum per-position attention mass per block, for H2O."""
    bs = cache.block_size
    n = min(mass.numel(), len(blocks) * bs)
    padded = torch.zeros(len(blocks) * bs, device=mass.device)
    padded[:n] = mass[:n]
    cache.record_attention(blocks, padded.view(len(blocks), bs).sum(-1).tolist())
