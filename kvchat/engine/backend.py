"""The model side of kvchat, and the only module that imports transformers.

A request looks up its prompt in the paged cache, turns the matched blocks into the
`DynamicCache` the model's forward expects, prefills only the missing tail (in chunks), decodes,
and on the way out - finished, stopped or interrupted - stores every position whose K/V it
computed back into the cache before releasing its blocks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator as PyGenerator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

from kvchat.cache.blocks import KV, Block
from kvchat.cache.kvcache import Lookup, PagedKVCache
from kvchat.config import CacheConfig, SamplingParams
from kvchat.engine.sampling import make_generator, sample
from kvchat.errors import KvchatError

H2O_ATTENTION = "kvchat_h2o"


class PromptTooLongError(KvchatError):
    pass


# ---- attention mass for H2O ----------------------------------------------------------------

_mass_sink = threading.local()


def _h2o_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Eager attention that also adds, per key position, the attention mass it received
    (summed over heads and queries) to the active sink: what H2O ranks blocks by."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)  # (B, H, K, D)
    value = value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    weights = torch.matmul(query, key.transpose(2, 3)) * scale  # (B, H, Q, K)
    if attention_mask is not None:
        weights = weights + attention_mask[:, :, :, : key.shape[-2]]
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    sink: list[torch.Tensor] | None = getattr(_mass_sink, "rows", None)
    if sink is not None:
        sink.append(weights.sum(dim=(1, 2)).float())  # (B, K)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()  # (B, Q, H, D)
    return out, None


AttentionInterface.register(H2O_ATTENTION, _h2o_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(H2O_ATTENTION, eager_mask)


# ---- transformers cache objects ------------------------------------------------------------


def _full_cache(config: Any) -> DynamicCache:
    """An empty DynamicCache whose layers all keep every position. Sliding-window layers would
    drop positions outside the window, and kvchat stores and reuses whole prefixes; the window
    itself is still applied by the attention mask the model builds from its config."""
    past = DynamicCache(config=config)
    past.layers = [DynamicLayer() for _ in past.layers]
    return past


def build_past(kv: Sequence[KV], config: Any) -> DynamicCache:
    """A DynamicCache holding copies of the given per-layer (1, H, T, D) K/V."""
    past = _full_cache(config)
    layers: list[Any] = list(past.layers)
    for layer, (k, v) in zip(layers, kv, strict=True):
        layer.update(k, v)
    return past


def wrap_past(kv: Sequence[KV], config: Any) -> DynamicCache:
    """A DynamicCache over the given per-layer (B, H, T, D) tensors, without copying them
    (the batched path builds its padded tensors itself)."""
    past = _full_cache(config)
    layers: list[Any] = list(past.layers)
    if len(layers) != len(kv):
        raise ValueError(f"model has {len(layers)} cache layers, got K/V for {len(kv)}")
    for layer, (k, v) in zip(layers, kv, strict=True):
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return past


class _ReservedLayer(DynamicLayer):
    """A cache layer whose K/V are the front of a larger buffer: each decode step writes the
    new column in place instead of concatenating, which copies the whole batch's K/V for that
    layer (a third of a padded 32-row decode step on CPU)."""

    def __init__(self, k_buf: torch.Tensor, v_buf: torch.Tensor, length: int) -> None:
        super().__init__()
        self.lazy_initialization(k_buf, v_buf)
        self._k, self._v = k_buf, v_buf
        self._len = length
        self.keys, self.values = k_buf[:, :, :length], v_buf[:, :, :length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start = self._len
        end = start + key_states.shape[-2]
        if end > self._k.shape[-2]:  # out of room: double, amortised like a list
            grow = max(end, 2 * self._k.shape[-2]) - self._k.shape[-2]
            pad = self._k.new_zeros(*self._k.shape[:2], grow, self._k.shape[-1])
            self._k = torch.cat([self._k, pad], dim=-2)
            self._v = torch.cat([self._v, pad], dim=-2)
        self._k[:, :, start:end] = key_states
        self._v[:, :, start:end] = value_states
        self._len = end
        keys, values = self._k[:, :, :end], self._v[:, :, :end]
        self.keys, self.values = keys, values
        return keys, values


def reserved_past(buffers: Sequence[KV], length: int, config: Any) -> DynamicCache:
    """A DynamicCache over the first `length` positions of per-layer (B, H, capacity, D)
    buffers; later positions are written in place as the batch decodes."""
    past = DynamicCache(config=config)
    if len(past.layers) != len(buffers):
        raise ValueError(f"model has {len(past.layers)} cache layers, got {len(buffers)}")
    past.layers = [_ReservedLayer(k, v, length) for k, v in buffers]
    return past


def past_length(past: DynamicCache) -> int:
    """Positions present in every layer (an interrupted forward can leave layers uneven)."""
    layers: list[Any] = list(past.layers)
    lengths = [layer.get_seq_length() for layer in layers]
    return min(lengths) if lengths else 0


def past_kv(past: DynamicCache, start: int, end: int) -> list[KV]:
    layers: list[Any] = list(past.layers)
    return [(layer.keys[:, :, start:end], layer.values[:, :, start:end]) for layer in layers]


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a decoder config."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def layer_devices(model: Any, n_layers: int) -> list[torch.device]:
    """The device of each decoder layer, so the pool for layer i lives where layer i runs."""
    fallback = next(model.parameters()).device
    decoder: Any = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers: Any = getattr(decoder, "layers", None)
    if layers is None or len(layers) != n_layers:
        return [fallback] * n_layers
    return [next(layer.parameters()).device for layer in layers]


# ---- requests and results ------------------------------------------------------------------


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    sid: str | None = None
    record_logits: bool = False  # keep every step's logits row (kvchat verify)


class PrefillLookup(NamedTuple):
    matched: int
    past_key_values: DynamicCache | None
    lookup: Lookup | None


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens (EOS included when the model emitted it)
    prompt_tokens: int
    cache_hit_tokens: int
    hit_source: str  # exact | radix | miss | off
    computed_tokens: int  # prompt tokens this request ran through the model
    prefill_ms: float
    ttft_ms: float
    decode_tokens_per_s: float
    total_ms: float
    finish_reason: str  # stop | length | interrupted
    stored_tokens: int  # tokens of prompt + reply now cached
    step_logits: list[torch.Tensor] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class Backend:
    """Model + tokenizer + (optionally) the shared paged cache."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        cache: PagedKVCache | None,
        prefill_chunk: int = 512,
    ) -> None:
        if prefill_chunk < 1:
            raise KvchatError(f"--prefill-chunk must be at least 1, got {prefill_chunk}.")
        self.model = model
        self.tokenizer = tokenizer
        self.cache = cache
        self.prefill_chunk = prefill_chunk
        self.device = next(model.parameters()).device
        config = model.config
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.track_attention = cache is not None and cache.policy.name == "h2o"
        if self.track_attention:
            model.set_attn_implementation(H2O_ATTENTION)
        eos: set[int] = set()
        for source in (getattr(model, "generation_config", None), tokenizer):
            ids = getattr(source, "eos_token_id", None)
            if ids is not None:
                eos.update([ids] if isinstance(ids, int) else ids)
        self.eos_ids = frozenset(eos)
        self.forward_calls = 0

    @classmethod
    def create(
        cls,
        model: Any,
        tokenizer: Any,
        cache_config: CacheConfig | None,
        prefill_chunk: int = 512,
    ) -> Backend:
        """A backend with a fresh pool sized by cache_config (None: no cache at all)."""
        cache = None
        if cache_config is not None:
            n_layers, kv_heads, head_dim = kv_shape(model.config)
            dtype = next(model.parameters()).dtype
            cache = PagedKVCache.create(
                cache_config, n_layers, kv_heads, head_dim, dtype, layer_devices(model, n_layers)
            )
        return cls(model, tokenizer, cache, prefill_chunk)

    def without_cache(self) -> Backend:
        """Same model, no cache: the cold reference for verify and benchmarks."""
        return Backend(self.model, self.tokenizer, None, self.prefill_chunk)

    # ---- text -------------------------------------------------------------------------------

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt=True)
        return self.encode(text)

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # ---- model calls ------------------------------------------------------------------------

    def prefill_lookup(
        self, tokens: Sequence[int], sid: str | None = None, defer_exact: bool = False
    ) -> PrefillLookup:
        """Cache lookup, then the matched blocks as the cache object the forward expects.
        The lookup's blocks stay acquired until the request finishes. With defer_exact, an exact
        hit returns no past yet: its first token needs only the stored logits, so the gather
        can wait until after that token is out (see `gather_past`)."""
        if self.cache is None:
            return PrefillLookup(0, None, None)
        lookup = self.cache.lookup(tokens, sid)
        if not lookup.matched or (defer_exact and lookup.logits is not None):
            return PrefillLookup(lookup.matched, None, lookup)
        return PrefillLookup(lookup.matched, self.gather_past(lookup), lookup)

    def gather_past(self, lookup: Lookup) -> DynamicCache:
        assert self.cache is not None
        kv = self.cache.gather(lookup.blocks, lookup.matched)
        # the gather already made fresh tensors: wrap them rather than copy them once more
        return wrap_past(kv, self.model.config)

    def forward(
        self, ids: Sequence[int], past: DynamicCache
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ids after `past` (which grows in place); returns the last position's logits
        (vocab,) and, for H2O, the attention mass per cached position (K,)."""
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        logits, mass = self.forward_batch(input_ids, past)
        return logits[0], None if mass is None else mass[0]

    def forward_batch(
        self,
        input_ids: torch.Tensor,
        past: DynamicCache,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        columns: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run (B, q) ids after a (B, ...) past; padded rows need the 2D attention_mask over
        past + q and explicit position_ids. Returns the last column's logits (B, vocab) - or,
        given `columns`, those columns' logits (B, len(columns), vocab) - and, for H2O,
        attention mass per key column (B, K)."""
        keep: int | torch.Tensor = 1
        if columns is not None:
            keep = torch.tensor(list(columns), dtype=torch.long, device=input_ids.device)
        rows: list[torch.Tensor] | None = [] if self.track_attention else None
        _mass_sink.rows = rows
        try:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past,
                use_cache=True,
                logits_to_keep=keep,
            )
        finally:
            _mass_sink.rows = None
        self.forward_calls += 1
        mass = torch.stack([r.to(self.device) for r in rows]).sum(0) if rows else None
        return (out.logits if columns is not None else out.logits[:, -1]), mass

    def empty_past(self) -> DynamicCache:
        return _full_cache(self.model.config)

    def check_request(self, request: Request) -> None:
        n = len(request.prompt_ids)
        if n == 0:
            raise KvchatError("The prompt is empty.")
        if n >= self.max_context:
            raise PromptTooLongError(
                f"The prompt has {n} tokens; the model's context is {self.max_context} tokens."
            )

    def start(self, request: Request, cancel: threading.Event | None = None) -> Generation:
        """Admit a request: look up its prompt now; iterate the result to run it."""
        self.check_request(request)
        t0 = time.perf_counter()  # time to first token counts the lookup and gather too
        pre = self.prefill_lookup(request.prompt_ids, request.sid, defer_exact=True)
        return Generation(self, request, pre, cancel, t0)

    def generate(self, request: Request) -> GenerationResult:
        return self.start(request).run()


class SequenceState:
    """Per-request decoding state shared by the sequential and the batched paths: sampling,
    incremental detokenisation with stop strings, timings, attention mass, and the final store."""

    def __init__(self, backend: Backend, request: Request, pre: PrefillLookup, t0: float) -> None:
        self.backend = backend
        self.request = request
        self.pre = pre
        self.t0 = t0
        self.generated: list[int] = []
        self.text = ""
        self.finish_reason = "length"
        self.done = False
        self.prompt_logits: torch.Tensor | None = None
        self.mass = torch.zeros(0, device=backend.device) if backend.track_attention else None
        self.step_logits: list[torch.Tensor] | None = [] if request.record_logits else None
        self.t_prefill = 0.0
        self.t_first = 0.0
        self._gen = make_generator(request.params, backend.device)
        self._cut_at_stop = False
        self._released = False  # the lookup's blocks went back
        self.result: GenerationResult | None = None

    @property
    def length(self) -> int:
        """Tokens fed to the model so far, once the last sampled token is fed too."""
        return len(self.request.prompt_ids) + len(self.generated)

    def prefill(self, past: DynamicCache | None, cancel: threading.Event | None = None) -> bool:
        """Run the uncached tail of the prompt in chunks; False if cancelled first. Exact hits
        skip this: their logits come from the cache."""
        b, tokens = self.backend, self.request.prompt_ids
        lookup = self.pre.lookup
        if lookup is not None and lookup.logits is not None:
            self.prompt_logits = lookup.logits  # exact repeat: no forward pass at all
        else:
            assert past is not None, "only an exact hit may defer its K/V"
            for lo in range(self.pre.matched, len(tokens), b.prefill_chunk):
                if cancel is not None and cancel.is_set():
                    self.finish_reason, self.done = "interrupted", True
                    return False
                logits, mass = b.forward(tokens[lo : lo + b.prefill_chunk], past)
                self.add_mass(mass)
                self.prompt_logits = logits
        self.t_prefill = time.perf_counter()
        return True

    def store_prompt(self, kv: Sequence[KV]) -> None:
        """Cache the prompt as soon as it is prefilled (kv: per layer, positions [0, n)), so
        requests admitted after this one hit it while this one is still decoding."""
        cache, pre = self.backend.cache, self.pre
        n = len(self.request.prompt_ids)
        if cache is None or pre.lookup is None or n <= pre.matched:
            return
        window = [(k[:, :, pre.matched : n], v[:, :, pre.matched : n]) for k, v in kv]
        logits = None if self.prompt_logits is None else self.prompt_logits.detach().clone()
        cache.store(self.request.prompt_ids, window, pre.matched, logits=logits,
                    sid=self.request.sid)

    def add_mass(self, step: torch.Tensor | None) -> None:
        if self.mass is not None and step is not None:
            self.mass = _add_mass(self.mass, step)

    def push(self, logits: torch.Tensor) -> str:
        """Sample the next token from `logits`; returns the new text (may be empty) and sets
        `done` when the request should stop."""
        b, params = self.backend, self.request.params
        if self.step_logits is not None:
            self.step_logits.append(logits.float().cpu())
        tok = sample(logits, params, self._gen)
        self.generated.append(tok)
        if len(self.generated) == 1:
            self.t_first = time.perf_counter()
        new_text = b.decode(self.generated)  # special tokens (EOS) decode to nothing
        hits = [new_text.index(s) for s in params.stop if s in new_text]
        if hits:
            cut = min(hits)
            delta, self.text = new_text[len(self.text) : cut], new_text[:cut]
            self._cut_at_stop = True
            self.finish_reason, self.done = "stop", True
            return delta
        if tok in b.eos_ids and not params.ignore_eos:
            self.finish_reason, self.done = "stop", True
        elif len(self.generated) >= params.max_new_tokens or self.length >= b.max_context:
            self.done = True
        delta = ""
        # hold back half a UTF-8 character until the next token completes it (or we stop)
        if self.done or not new_text.endswith("\ufffd"):
            delta, self.text = new_text[len(self.text) :], new_text
        return delta

    def interrupt(self) -> None:
        self.finish_reason, self.done = "interrupted", True

    def finish(self, kv: Sequence[KV] | None, kv_len: int) -> GenerationResult:
        """Store positions [pre.matched, kv_len) whose K/V are in `kv` (per layer, covering just
        that range), release the request's blocks, and build the result. Idempotent, and the
        result is set even if an interrupt lands in the store (which then keeps nothing)."""
        if self.result is not None:
            return self.result
        b, pre = self.backend, self.pre
        stored = pre.matched
        cache = b.cache
        try:
            if cache is not None and pre.lookup is not None and not self._released:
                try:
                    if kv is not None and kv_len > pre.matched:
                        stored = self._store(cache, kv, kv_len)
                finally:
                    self._released = True  # a second finish must not release them again
                    cache.release(pre.lookup.blocks)
        finally:
            self.result = self._result(stored)
        return self.result

    def _store(self, cache: PagedKVCache, kv: Sequence[KV], kv_len: int) -> int:
        req, pre = self.request, self.pre
        seq = (list(req.prompt_ids) + self.generated)[:kv_len]
        logits = self.prompt_logits
        res = cache.store(
            seq,
            kv,
            pre.matched,
            logits=None if logits is None else logits.detach().clone(),
            logits_len=len(req.prompt_ids),
            sid=req.sid,
        )
        # res.blocks are valid until the next cache mutation: score them right away
        if self.mass is not None and self.mass.numel():
            _record_mass(cache, res.blocks, self.mass)
        return res.stored

    def _result(self, stored: int) -> GenerationResult:
        b, pre = self.backend, self.pre
        n = len(self.request.prompt_ids)
        if not self._cut_at_stop:
            self.text = b.decode(self.generated)
        t_end = time.perf_counter()
        decode_s = t_end - self.t_first if self.t_first else 0.0
        source = pre.lookup.source.value if pre.lookup is not None else "off"
        return GenerationResult(
            text=self.text,
            token_ids=list(self.generated),
            prompt_tokens=n,
            cache_hit_tokens=pre.matched,
            hit_source=source,
            computed_tokens=n - pre.matched,
            prefill_ms=(self.t_prefill - self.t0) * 1000 if self.t_prefill else 0.0,
            ttft_ms=(self.t_first - self.t0) * 1000 if self.t_first else 0.0,
            decode_tokens_per_s=(len(self.generated) - 1) / decode_s if decode_s > 0 else 0.0,
            total_ms=(t_end - self.t0) * 1000,
            finish_reason=self.finish_reason,
            stored_tokens=stored,
            step_logits=self.step_logits,
        )


class Generation:
    """One request in flight, run on its own. Iterating yields text deltas as tokens are
    decoded; when iteration ends (or `close()` is called) the computed K/V is stored and
    `result` is set."""

    def __init__(
        self,
        backend: Backend,
        request: Request,
        pre: PrefillLookup,
        cancel: threading.Event | None = None,
        t0: float | None = None,
    ) -> None:
        self.backend = backend
        self.request = request
        self.pre = pre
        self.cancel_event = cancel or threading.Event()
        self.state = SequenceState(backend, request, pre, time.perf_counter() if t0 is None else t0)
        self._iter: PyGenerator[str, None, None] | None = None

    @property
    def result(self) -> GenerationResult | None:
        return self.state.result

    def __iter__(self) -> Iterator[str]:
        if self._iter is None:
            self._iter = self._run()
        return self._iter

    def run(self) -> GenerationResult:
        for _ in self:
            pass
        assert self.state.result is not None
        return self.state.result

    def cancel(self) -> None:
        self.cancel_event.set()

    def close(self) -> None:
        """Stop now (e.g. the client went away) and store what was computed."""
        if self._iter is None:
            self.state.interrupt()
            self.state.finish(None, 0)
        else:
            self._iter.close()

    def _run(self) -> PyGenerator[str, None, None]:
        b, st, pre = self.backend, self.state, self.pre
        past = pre.past_key_values
        if past is None and not pre.matched:
            past = b.empty_past()
        try:
            with torch.inference_mode():
                if not st.prefill(past, self.cancel_event):
                    return
                assert st.prompt_logits is not None
                logits = st.prompt_logits
                while True:
                    delta = st.push(logits)
                    if delta:
                        yield delta
                    if not st.done and self.cancel_event.is_set():
                        st.interrupt()
                    if st.done:
                        break
                    if past is None:  # a deferred exact hit: K/V needed from the 2nd token on
                        assert pre.lookup is not None
                        past = b.gather_past(pre.lookup)
                    logits, mass = b.forward([st.generated[-1]], past)
                    st.add_mass(mass)
        except BaseException:  # Ctrl-C, a closed stream, or a failure: keep what was computed
            st.interrupt()
            raise
        finally:
            kv_len = past_length(past) if past is not None else 0
            kv = past_kv(past, pre.matched, kv_len) if past is not None else None
            st.finish(kv, kv_len)


def _add_mass(total: torch.Tensor | None, step: torch.Tensor | None) -> torch.Tensor | None:
    """Accumulate per-position attention mass; positions are appended as the sequence grows."""
    if total is None or step is None:
        return total
    if step.numel() > total.numel():
        total = torch.cat([total, total.new_zeros(step.numel() - total.numel())])
    total[: step.numel()] += step
    return total


def _record_mass(cache: PagedKVCache, blocks: Sequence[Block], mass: torch.Tensor) -> None:
    bs = cache.block_size
    n = min(mass.numel(), len(blocks) * bs)
    padded = torch.zeros(len(blocks) * bs, device=mass.device)
    padded[:n] = mass[:n]
    per_block = padded.view(len(blocks), bs).sum(-1).tolist()
    cache.record_attention(blocks, per_block)

