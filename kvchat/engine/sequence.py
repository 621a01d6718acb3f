"""One request inside the engine: what it asked for, where it is, what it has produced.

A `Sequence` owns its status (one enum: the only place "finished" lives), its cancel flag, its
token ids, the cache blocks its lookup acquired, and its timings. The engine moves it through
WAITING -> RUNNING -> FINISHED; `push()` samples a token and turns it into text.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from kvchat.cache.lookup import Lookup
from kvchat.cache.visibility import Visibility
from kvchat.config import SamplingParams
from kvchat.engine.past import Pieces
from kvchat.engine.result import GenerationResult
from kvchat.engine.sampling import make_generator, sample


class Status(StrEnum):
    WAITING = "waiting"  # submitted, not admitted yet
    RUNNING = "running"  # looked up; prefilling or decoding
    FINISHED = "finished"  # result (or error) set, blocks released


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    sid: str | None = None  # session name, for per-session cache counters
    record_logits: bool = False  # keep every step's logits row (kvchat verify)
    namespace: str = ""  # cache namespace: entries of one are never a hit in another
    own_from: int = 0  # where the request's own text starts (after a history / system prompt)
    after_history: bool = False  # own_from ends a session's history (else a shared head)
    # what the caller may see of that namespace's cached tokens (its `miss_detail`)
    visibility: Visibility = Visibility.CACHE


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class Finished:
    """The last event of a request: its result, or the error that kept it from running."""

    result: GenerationResult | None
    error: Exception | None = None


Event = TextDelta | Finished
Decode = Callable[[list[int]], str]


class Sequence:
    def __init__(self, seq_id: int, request: Request, emit: Callable[[Event], None]) -> None:
        self.seq_id = seq_id
        self.request = request
        self.params = request.params
        self.emit = emit
        self.status = Status.WAITING
        self.cancel_event = threading.Event()
        self.generated: list[int] = []
        self.text = ""  # what was emitted as deltas so far
        self.finish_reason = "length"
        self.result: GenerationResult | None = None
        self.error: Exception | None = None
        self.lookup: Lookup | None = None  # its blocks stay acquired until the sequence ends
        self.prompt_logits: torch.Tensor | None = None
        self.mass: torch.Tensor | None = None  # attention mass per position (H2O only)
        self.step_logits: list[torch.Tensor] | None = [] if request.record_logits else None
        self.kv: Pieces | None = None  # its own K/V of [0, kv_len) until it joins the batch
        self.kv_len = 0  # positions whose K/V exist
        self.stored = 0  # leading positions known to be cached
        self.t_submit = time.perf_counter()
        self.t0 = 0.0  # admission: time to first token counts the lookup and gather too
        self.t_prefill = 0.0
        self.t_first = 0.0
        self._gen: torch.Generator | None = None
        self._cut_at_stop = False
        self._stopped = False  # a stop, a limit or a cancel: finishes at the end of this step
        self.draft_tokens = self.draft_accepted = self.decode_forwards = 0
        self.replayed = 0  # reply tokens taken from a stored greedy reply (`engine/replay.py`)
        self.draft_retry_at = 0  # no draft lookup before this length (the last one missed)

    # ---- facts ----

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @functools.cached_property
    def prompt_key(self) -> tuple[str, tuple[int, ...]]:
        """(namespace, prompt): what two requests share when one is an exact repeat of the
        other."""
        return self.request.namespace, tuple(self.prompt_ids)

    @property
    def matched(self) -> int:
        return self.lookup.matched if self.lookup is not None else 0

    @property
    def exact(self) -> bool:
        return self.lookup is not None and self.lookup.logits is not None

    @property
    def length(self) -> int:
        """Tokens fed to the model so far, once the last sampled token is fed too."""
        return len(self.prompt_ids) + len(self.generated)

    @property
    def done(self) -> bool:
        """No more tokens: finished, or about to be (a stop, a limit, a cancel)."""
        return self.status is Status.FINISHED or self._stopped

    def tokens(self) -> list[int]:
        return list(self.prompt_ids) + self.generated

    # ---- control ----

    def cancel(self) -> None:
        """Stop at the next step (any thread); what it computed is still cached."""
        self.cancel_event.set()

    def stop(self, reason: str) -> None:
        self.finish_reason, self._stopped = reason, True

    def check_cancel(self) -> bool:
        if not self._stopped and self.cancel_event.is_set():
            self.stop("interrupted")
        return self._stopped

    # ---- tokens ----

    def add_mass(self, step: torch.Tensor | None) -> None:
        """Accumulate per-position attention mass; positions are appended as it grows."""
        if self.mass is None or step is None:
            return
        if step.numel() > self.mass.numel():
            grow = self.mass.new_zeros(step.numel() - self.mass.numel())
            self.mass = torch.cat([self.mass, grow])
        self.mass[: step.numel()] += step

    def push(self, logits: torch.Tensor, decode: Decode, eos_ids: frozenset[int],
             max_context: int) -> str:
        """Sample the next token from a (vocab,) row; returns the new text (may be empty) and
        stops the sequence at EOS, a stop string or a limit."""
        params = self.params
        if self.step_logits is not None:
            self.step_logits.append(logits.float().cpu())
        if self._gen is None and not params.greedy:
            self._gen = make_generator(params, logits.device)
        return self.take(sample(logits, params, self._gen), decode, eos_ids, max_context)

    def take(self, tok: int, decode: Decode, eos_ids: frozenset[int], max_context: int) -> str:
        """Append a token chosen elsewhere (sampled by `push`, or replayed from a stored greedy
        reply); returns the new text (may be empty) and stops the sequence at EOS, a stop string
        or a limit, exactly as `push` does."""
        params = self.params
        self.generated.append(tok)
        if len(self.generated) == 1:
            self.t_first = time.perf_counter()
        new_text = decode(self.generated)  # special tokens (EOS) decode to nothing
        hits = [new_text.index(s) for s in params.stop if s in new_text]
        if hits:
            cut = min(hits)
            delta, self.text = new_text[len(self.text) : cut], new_text[:cut]
            self._cut_at_stop = True
            self.stop("stop")
            return delta
        if tok in eos_ids and not params.ignore_eos:
            self.stop("stop")
        elif len(self.generated) >= params.max_new_tokens or self.length >= max_context:
            self.stop("length")
        # hold back half a UTF-8 character until the next token completes it (or we stop),
        # and text that may be the start of a stop string (cut, if the string completes)
        if self._stopped or not new_text.endswith("\ufffd"):
            upto = len(new_text) - (0 if self._stopped else _stop_start(new_text, params.stop))
            delta, self.text = new_text[len(self.text) : upto], new_text[:upto]
            return delta
        return ""

    def unsent(self) -> str:
        """Text of the result not yet emitted as a delta: what was held back as a possible
        stop string when the sequence ended another way (an interrupt)."""
        text = self.result.text if self.result is not None else ""
        return text[len(self.text) :] if text.startswith(self.text) else ""

    # ---- the end ----

    def result_of(self, decode: Decode, stored: int) -> GenerationResult:
        n = len(self.prompt_ids)
        text = self.text if self._cut_at_stop else decode(self.generated)  # self.text: sent
        t_end = time.perf_counter()
        t0 = self.t0 or self.t_submit
        decode_s = t_end - self.t_first if self.t_first else 0.0
        source = self.lookup.source.value if self.lookup is not None else "off"
        return GenerationResult(
            text=text,
            token_ids=list(self.generated),
            prompt_tokens=n,
            cache_hit_tokens=self.matched,
            hit_source=source,
            computed_tokens=n - self.matched,
            prefill_ms=(self.t_prefill - t0) * 1000 if self.t_prefill else 0.0,
            ttft_ms=(self.t_first - t0) * 1000 if self.t_first else 0.0,
            # a replayed reply was not decoded: it has no rate
            decode_tokens_per_s=(len(self.generated) - 1) / decode_s
            if decode_s > 0 and not self.replayed else 0.0,
            total_ms=(t_end - t0) * 1000,
            finish_reason=self.finish_reason,
            stored_tokens=stored,
            step_logits=self.step_logits,
            disk_hit_tokens=self.lookup.disk_tokens if self.lookup is not None else 0,
            shared_hit_tokens=self.lookup.shared_tokens if self.lookup is not None else 0,
            draft_tokens=self.draft_tokens,
            draft_accepted=self.draft_accepted,
            decode_forwards=self.decode_forwards,
            replayed_tokens=self.replayed,
            **self._miss_fields(decode),
        )

    def _miss_fields(self, decode: Decode) -> dict[str, Any]:
        why = self.lookup.why if self.lookup is not None else None
        if why is None:
            return {}
        return {"miss_reason": why.reason.value, "diverged_at": why.diverged_at,
                "miss_detail": why.describe(self.prompt_ids, decode, self.request.visibility),
                "miss_label": why.label(self.request.own_from, self.request.after_history)}

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.status.value}, prompt={len(self.prompt_ids)}, "
                f"generated={len(self.generated)})")


def _stop_start(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` begin one of `stops` (0 when none do)."""
    return max((n for stop in stops for n in range(min(len(stop) - 1, len(text)), 0, -1)
                if text.endswith(stop[:n])), default=0)
