"""ModelRunner: every forward pass kvchat makes, and the K/V each one leaves behind.

It prefills a prompt's uncached tail (in chunks, after the gathered past), prefills several short
tails in one left-padded forward, and runs a decode step over a batch it is given. It holds no
request state beyond what a call is handed; the engine decides what runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from transformers import DynamicCache

from kvchat.cache.blocks import KV
from kvchat.engine.attention import attention_mass, track_attention
from kvchat.engine.decode_attention import NAME, use_decode_attention
from kvchat.engine.forward_plan import compiled, confirm, plan_of
from kvchat.engine.fused_decode import FusedDecoder
from kvchat.engine.past import (
    Pieces,
    empty_past,
    has_head,
    pack_right_aligned,
    past_kv,
    reserved_past,
    wrap_past,
)
from kvchat.models.dense_rows import fix_dense_rows
from kvchat.models.quant import precision_of, rows_alone


class Prefilled(NamedTuple):
    logits: torch.Tensor  # (vocab,) at the prompt's last position
    kv: Pieces  # positions [0, L): per layer (1, H, n, D) runs, read with .range()
    kv_len: int


class ModelRunner:
    def __init__(self, model: Any, prefill_chunk: int = 512, policy: str | None = None) -> None:
        """`policy`: the eviction policy's name (H2O's needs attention mass per key)."""
        self.model = model
        self.config = model.config
        self.prefill_chunk = prefill_chunk
        self.device = next(model.parameters()).device
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        use_decode_attention(model)
        fix_dense_rows(model)  # float layers: one GEMM shape whatever the rows
        plan = plan_of(model, self.precision, str(self.dtype).removeprefix("torch."),
                       self.device.type, policy)
        self.track_mass = plan.attention_mass  # H2O: report attention mass per key position
        self.forward_calls = 0
        self._decode_fn: Callable[..., Any] | None = None  # compiled forward of decode steps
        # decode steps and drafts of quantized models of the common families: the same logits,
        # fewer ops (built before H2O's tracking renames the attention, so that a runner without
        # it on the same model still has it)
        self.fused = FusedDecoder.build(model)
        self.plan = confirm(plan, None if self.fused is None else self.fused.shares_heads,
                            str(self.config._attn_implementation) == NAME, rows_alone(model),
                            0 if self.fused is None else self.fused.native_layers)
        if self.track_mass:
            track_attention(model)

    def compile_decode(self) -> None:
        """Run one-token decode steps through `torch.compile` (dynamic shapes: one graph per
        batch of one and one for larger batches, reused as the context grows). Prefill, draft
        verification and H2O's tracked forwards stay eager, and so does a one-row step where
        the fused forward runs (it is faster than the compiled model forward there: SmolLM2
        int4, 8.9 vs 10.6 ms per token; a batch of 8 compiled, 417 vs 361 tokens/s). The
        compiled step fuses small ops, so its logits round differently from the eager ones
        (bfloat16: ties, as in a batch)."""
        import torch

        self._decode_fn = torch.compile(self.model.forward, dynamic=True)
        self.plan = compiled(self.plan)

    @property
    def attends_heads(self) -> bool:
        """Whether a decode batch may hold the K/V its rows all start with once (a
        `reserved_past` head): only the fused forward reads it (`ForwardPlan.shared_head`)."""
        return self.plan.shared_head

    @property
    def invariant(self) -> bool:
        """Whether a sequence's logits and K/V are bitwise the same whatever else is in the
        forward (batch, padding, drafts, a shared head, prefill chunks, threads): see
        `ForwardPlan.limits` for what keeps it from being so."""
        return self.plan.invariant

    @property
    def dtype(self) -> torch.dtype:
        """Of activations and K/V (bfloat16 under quantized weights)."""
        return next(self.model.parameters()).dtype

    @property
    def precision(self) -> str:
        """What the weights run at: a float dtype name, int8 or int4."""
        return precision_of(self.model)

    @property
    def precision_label(self) -> str:
        name, compute = self.precision, str(self.dtype).removeprefix("torch.")
        return name if name == compute else f"{name} weights, {compute} compute"

    def forward(
        self,
        input_ids: torch.Tensor,
        past: DynamicCache,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        columns: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run (B, q) ids after a (B, ...) past, which grows in place. Padded rows need the 2D
        attention_mask over past + q and explicit position_ids. Returns the last column's logits
        (B, vocab) - or, given `columns`, those columns' (B, len(columns), vocab) - and, when
        tracking, attention mass per key column (B, K) summed over layers."""
        keep: int | torch.Tensor = 1
        if columns is not None:
            keep = torch.tensor(list(columns), dtype=torch.long, device=input_ids.device)
        one_token = input_ids.shape[1] == 1 and columns is None and not self.track_mass
        fused = self.fused if self.plan.fused else None  # the plan says which forward runs
        fused_row = fused is not None and input_ids.shape[0] == 1
        self.forward_calls += 1
        if one_token and self._decode_fn is not None and not fused_row:
            call = self._decode_fn
        elif fused is not None and fused.takes(input_ids):
            logits = fused.forward(input_ids, past, attention_mask, position_ids, keep)
            return (logits if columns is not None else logits[:, -1]), None
        else:
            call = self.model
        if has_head(past):
            raise RuntimeError("a past with a shared head needs the fused decode forward")
        with attention_mass(self.track_mass) as rows:
            out = call(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past,
                use_cache=True,
                logits_to_keep=keep,
            )
        mass = torch.stack([r.to(self.device) for r in rows]).sum(0) if rows else None
        return (out.logits if columns is not None else out.logits[:, -1]), mass

    def past(self, kv: Sequence[KV] | None = None) -> DynamicCache:
        """A cache object over gathered (1, H, T, D) K/V, wrapped without a copy, or empty."""
        return wrap_past(kv, self.config) if kv else empty_past(self.config)

    def prefill(
        self,
        tokens: Sequence[int],
        start: int,
        past: DynamicCache,
        cancelled: Callable[[], bool],
        on_mass: Callable[[torch.Tensor | None], None],
    ) -> torch.Tensor | None:
        """Run positions [start, len(tokens)) after `past` (positions [0, start)) in chunks;
        `past` grows in place, so a caller interrupted midway still has every whole chunk.
        Returns the last position's logits (vocab,), or None if `cancelled()` stopped it."""
        logits = None
        for lo in range(start, len(tokens), self.prefill_chunk):
            if cancelled():
                return None
            ids = torch.tensor([list(tokens[lo : lo + self.prefill_chunk])],
                               dtype=torch.long, device=self.device)
            out, mass = self.forward(ids, past)
            on_mass(None if mass is None else mass[0])
            logits = out[0]
        return logits

    def prefill_packed(
        self, tails: Sequence[Sequence[int]], pasts: Sequence[Sequence[KV] | None],
        matched: Sequence[int],
    ) -> list[Prefilled]:
        """One forward for the uncached tails of several prompts: pasts right-aligned in a
        left-padded block, tails left-aligned after it (pad queries then still see real keys,
        so no attention row is fully masked)."""
        n_rows = len(tails)
        p_len, t_len = max(matched), max(len(t) for t in tails)
        ref = next((p for p in pasts if p is not None), None)
        past = empty_past(self.config)
        if ref is not None:  # room for the tails too: the forward writes them in place
            kv = pack_right_aligned(pasts, matched, p_len, p_len + t_len, like=ref)
            past = reserved_past(kv, p_len, self.config)
        dev = self.device
        mask = torch.zeros(n_rows, p_len + t_len, dtype=torch.long, device=dev)
        ids = torch.zeros(n_rows, t_len, dtype=torch.long, device=dev)
        pos = torch.zeros(n_rows, t_len, dtype=torch.long, device=dev)
        for i, tail in enumerate(tails):
            mask[i, p_len - matched[i] : p_len + len(tail)] = 1
            ids[i, : len(tail)] = torch.tensor(list(tail), device=dev)
            pos[i] = torch.arange(matched[i], matched[i] + t_len, device=dev)
        last_cols = sorted({len(t) - 1 for t in tails})
        logits, _ = self.forward(ids, past, mask, pos, columns=last_cols)
        full = past_kv(past, 0, p_len + t_len)
        out = []
        for i, tail in enumerate(tails):
            # a row's real positions are one run: its past right-aligned, its tail after it
            lo, hi = p_len - matched[i], p_len + len(tail)
            row = [(k[i : i + 1, :, lo:hi], v[i : i + 1, :, lo:hi]) for k, v in full]
            out.append(Prefilled(logits[i, last_cols.index(len(tail) - 1)], Pieces(row),
                                 hi - lo))
        return out

    def prefill_shared(self, tails: Sequence[Sequence[int]], past: Sequence[KV],
                       p_len: int) -> list[Prefilled]:
        """One forward for the tails of several prompts that share one cached past (per layer
        (1, H, p_len, D)): the tails side by side in one row after it, each seeing the past and
        itself only (a block-diagonal causal mask). Against `prefill_packed` no row is padded
        and the shared past is in the forward once, not once per row; each row's K/V is that
        past (the same tensors for all) and then its own tail."""
        starts = [0]
        for tail in tails:
            starts.append(starts[-1] + len(tail))
        n = starts[-1]
        width = p_len + n
        dev = self.device
        past_obj = reserved_past(pack_right_aligned([past], [p_len], p_len, width, like=past),
                                 p_len, self.config)
        ids = torch.tensor([[t for tail in tails for t in tail]], dtype=torch.long, device=dev)
        pos = torch.cat([torch.arange(p_len, p_len + len(t), device=dev) for t in tails])[None]
        mask = torch.zeros(1, 1, n, width, dtype=torch.bool, device=dev)
        mask[..., :p_len] = True
        for lo, hi in zip(starts, starts[1:], strict=False):
            mask[0, 0, lo:hi, p_len + lo : p_len + hi] = torch.ones(
                hi - lo, hi - lo, dtype=torch.bool, device=dev).tril()
        last = [hi - 1 for hi in starts[1:]]
        logits, _ = self.forward(ids, past_obj, mask, pos, columns=last)
        full = past_kv(past_obj, 0, width)
        out = []
        for i, (lo, hi) in enumerate(zip(starts, starts[1:], strict=False)):
            own = [(k[:, :, p_len + lo : p_len + hi], v[:, :, p_len + lo : p_len + hi])
                   for k, v in full]
            out.append(Prefilled(logits[0, i], Pieces(past, own), p_len + hi - lo))
        return out

    @property
    def masks_by_position(self) -> bool:
        """Whether a custom 4-D mask says all the model's attention needs (no sliding window,
        which the model would apply from positions itself)."""
        return not getattr(self.config, "sliding_window", None)
