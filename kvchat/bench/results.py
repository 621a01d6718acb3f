"""What a `kvchat bench` run measured: small typed results and the one way to print a time.

Plain data, no torch: the benches (kvchat/bench/) build these and the views (ui/bench_view.py)
render them, so the views never import a bench.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Literal

from kvchat.cache.stats import ratio

TimeUnit = Literal["s", "ms"]
PREFILL_TARGET = 0.02  # a gather should cost under 2% of the prefill it replaces


@dataclass(frozen=True)
class Timing:
    """One figure over repeated trials, in seconds: median, min and max."""

    median_s: float
    min_s: float
    max_s: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Timing:
        """The median, min and max of per-trial seconds."""
        return cls(statistics.median(samples), min(samples), max(samples))

    def per(self, n: int) -> Timing:
        return Timing(self.median_s / n, self.min_s / n, self.max_s / n)

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3

    @property
    def min_ms(self) -> float:
        return self.min_s * 1e3

    @property
    def max_ms(self) -> float:
        return self.max_s * 1e3

    @property
    def spread(self) -> float:
        """Half the range of the trials relative to the median: the noise of this figure."""
        return (self.max_s - self.min_s) / 2 / self.median_s if self.median_s else 0.0

    def as_json(self, unit: TimeUnit = "s") -> dict[str, float]:
        scale = 1e3 if unit == "ms" else 1.0
        return {f"median_{unit}": self.median_s * scale, f"min_{unit}": self.min_s * scale,
                f"max_{unit}": self.max_s * scale}


def format_seconds(seconds: float) -> str:
    """A duration in the unit that keeps it short, with three or four significant digits:
    2.50 s, 230.5 ms, 6.54 ms, 32.0 µs, 40 ns."""
    if seconds >= 1:
        return f"{seconds:,.2f} s"
    if seconds >= 1e-3:
        ms = seconds * 1e3
        return f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"
    if seconds >= 1e-6:
        return f"{seconds * 1e6:.1f} µs"
    return f"{seconds * 1e9:.0f} ns"


def as_json(obj: Any, unit: TimeUnit = "s") -> Any:
    """JSON-ready form of a result: dataclasses as dicts of their fields, tuples as lists, and
    each Timing as {median_<unit>, min_<unit>, max_<unit>}."""
    if isinstance(obj, Timing):
        return obj.as_json(unit)
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: as_json(getattr(obj, f.name), unit) for f in fields(obj)}
    if isinstance(obj, list | tuple):
        return [as_json(item, unit) for item in obj]
    return obj


# ---- bench cache ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LookupTiming:
    prompt_tokens: int
    timing: Timing

    @property
    def ns_per_token(self) -> float:
        return self.timing.median_s / self.prompt_tokens * 1e9


@dataclass(frozen=True)
class TreeRow:
    cached_blocks: int  # blocks in the tree while measuring
    tree_nodes: int
    tree_leaves: int
    path_nodes: int  # nodes on the measured prompt's path: what a lookup walks
    max_siblings: int  # the largest group of siblings sharing a first token
    lookups: tuple[LookupTiming, ...]  # a full hit, one per prompt length
    store: Timing  # a fresh prompt of `prompt_tokens`, pool not full
    evict_per_block: Timing


@dataclass(frozen=True)
class BandwidthResult:
    tokens: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    device: str
    kv_bytes: int  # K and V of `tokens` positions, all layers
    gather: Timing
    store: Timing
    memcpy: Timing  # clone of one buffer of kv_bytes: allocate + copy, as gather does
    copy: Timing  # copy_ into a preallocated buffer: no page faults, the machine's peak
    prefill: Timing | None  # the model's forward over `tokens` fresh tokens, if a model was given

    @property
    def gather_gb_s(self) -> float:
        return self.kv_bytes / self.gather.median_s / 1e9

    @property
    def store_gb_s(self) -> float:
        return self.kv_bytes / self.store.median_s / 1e9

    @property
    def memcpy_gb_s(self) -> float:
        return self.kv_bytes / self.memcpy.median_s / 1e9

    @property
    def copy_gb_s(self) -> float:
        return self.kv_bytes / self.copy.median_s / 1e9

    @property
    def gather_vs_prefill(self) -> float | None:
        return None if self.prefill is None else self.gather.median_s / self.prefill.median_s

    @property
    def store_vs_prefill(self) -> float | None:
        return None if self.prefill is None else self.store.median_s / self.prefill.median_s


@dataclass(frozen=True)
class CacheBenchResult:
    block_size: int
    policy: str
    prompt_tokens: int
    trials: int
    tree: tuple[TreeRow, ...]
    bandwidth: BandwidthResult

    @property
    def lookup_size_ratio(self) -> float:
        """Lookup of the full prompt at the largest cache over the same at the smallest."""
        def full(row: TreeRow) -> float:
            return max(row.lookups, key=lambda lk: lk.prompt_tokens).timing.median_s

        return full(self.tree[-1]) / full(self.tree[0])

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = as_json(self, "s")
        for row, row_out in zip(self.tree, out["tree"], strict=True):
            for lk, lk_out in zip(row.lookups, row_out["lookups"], strict=True):
                lk_out["ns_per_token"] = lk.ns_per_token
        bw = self.bandwidth
        out["bandwidth"].update(
            gather_gb_s=bw.gather_gb_s,
            store_gb_s=bw.store_gb_s,
            memcpy_gb_s=bw.memcpy_gb_s,
            copy_gb_s=bw.copy_gb_s,
            gather_vs_prefill=bw.gather_vs_prefill,
            store_vs_prefill=bw.store_vs_prefill,
        )
        out["lookup_size_ratio"] = self.lookup_size_ratio
        return out


# ---- bench policies ------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyRow:
    policy: str
    requests: int
    prompt_tokens: int
    hit_tokens: int
    requests_hit: int
    evictions: int
    scores: str  # "synthetic" or "model"

    @property
    def hit_rate(self) -> float:
        return ratio(self.hit_tokens, self.prompt_tokens)


# ---- bench batch ---------------------------------------------------------------------------

GENERATE = "model.generate"  # the reference: plain greedy generate, one request at a time
LLAMA_SERVER = "llama-server"  # one request at a time, one slot
LLAMA_SERVER_8 = "llama-server x8"  # 8 requests at once, 8 slots
PEERS = (GENERATE, "generate_batch", LLAMA_SERVER, LLAMA_SERVER_8)


@dataclass(frozen=True)
class Contender:
    """One runner on one workload. outputs: the greedy tokens per line, in file order."""

    name: str
    seconds: float | None  # None: it could not run (note says why)
    outputs: tuple[tuple[int, ...], ...] = ()
    prefill_tokens: int | None = None  # prompt tokens run through the model; None: not known
    hit_tokens: int | None = None  # prompt tokens taken from a cache (kvchat)
    note: str = ""


@dataclass(frozen=True)
class BatchBench:
    """One workload kind through every runner, with what a perfect prefix cache would do."""

    kind: str
    requests: int
    prompt_tokens: int
    new_tokens: int
    ideal_prefill: int  # each distinct prefix computed once
    ideal_hits: int  # per line, its longest prefix shared with an earlier line (see workloads)
    contenders: tuple[Contender, ...]

    def get(self, name: str) -> Contender | None:
        return next((c for c in self.contenders if c.name == name), None)

    def speedup(self, baseline: str, name: str = "kvchat") -> float | None:
        """baseline's wall time over name's: above 1 when name is faster."""
        a, b = self.get(baseline), self.get(name)
        if a is None or b is None or not a.seconds or not b.seconds:
            return None
        return a.seconds / b.seconds

    def identical(self, name: str) -> int | None:
        """Lines whose greedy output equals plain generate's (None: nothing to compare)."""
        ref, c = self.get(GENERATE), self.get(name)
        if ref is None or c is None or not ref.outputs or len(c.outputs) != len(ref.outputs):
            return None
        return sum(a == b for a, b in zip(c.outputs, ref.outputs, strict=True))

    def reuse(self, name: str = "kvchat") -> float | None:
        """Cache-hit tokens over the ideal; above 1 where generated tokens, cached too, match
        the next line's prompt."""
        c = self.get(name)
        if c is None or c.hit_tokens is None or c.seconds is None:
            return None
        return ratio(c.hit_tokens, self.ideal_hits)

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "ideal_prefill_tokens": self.ideal_prefill,
            "ideal_hit_tokens": self.ideal_hits,
            "contenders": [
                {"name": c.name, "seconds": c.seconds, "prefill_tokens": c.prefill_tokens,
                 "hit_tokens": c.hit_tokens, "reuse": self.reuse(c.name),
                 "identical_outputs": self.identical(c.name),
                 "speedup_vs": {p: self.speedup(p, c.name) for p in PEERS
                                if p != c.name and self.get(p) is not None},
                 "note": c.note}
                for c in self.contenders
            ],
        }


@dataclass(frozen=True)
class BatchSuite:
    """`kvchat bench batch`: one BatchBench per workload kind, measured in one run."""

    new_tokens: int
    kinds: tuple[BatchBench, ...]
    torch_threads: int = 0  # batched matmuls slow down sharply when threads outnumber free cores

    @property
    def peers(self) -> tuple[str, ...]:
        """The peers that ran in this suite, in PEERS order."""
        return tuple(p for p in PEERS if any(k.get(p) is not None for k in self.kinds))

    def as_dict(self) -> dict[str, Any]:
        return {"new_tokens": self.new_tokens, "torch_threads": self.torch_threads,
                "kinds": [k.as_dict() for k in self.kinds]}


# ---- bench decode --------------------------------------------------------------------------


@dataclass(frozen=True)
class RowsRate:
    rows: int
    tokens_per_s: float  # all rows together


@dataclass(frozen=True)
class LoadCost:
    """One load of a model: its wall time and the resident memory of the process that holds it
    (bytes; VmRSS and VmHWM of /proc/PID/status, None where there is none).

    kvchat: `rss_before` / `rss_after` around `load_model` in the bench's process (models loaded
    earlier in it included), `peak` its high-water mark during the load (reset just before).
    llama-server: from its start to /health answering 200, `rss_after` its VmRSS then (it starts
    at nothing: `rss_before` None), `peak` its high-water mark over all its requests."""

    seconds: float
    rss_before: int | None
    rss_after: int | None
    peak: int | None

    @property
    def added(self) -> int | None:
        """What this load left resident."""
        if self.rss_after is None or self.rss_before is None:
            return None
        return self.rss_after - self.rss_before


@dataclass(frozen=True)
class PrecisionDecode:
    """kvchat at one precision."""

    precision: str
    step_bytes: int  # weights one decode step reads
    decode_s_per_token: Timing  # one stream, a fresh prompt
    rows: tuple[RowsRate, ...]
    prefill_tps: float  # a fresh prompt of DecodeResult.prefill_tokens
    repeat_forwards_per_token: float  # a repeated greedy request, drafted from the cache
    repeat_s_per_token: float
    load: LoadCost | None = None  # None for a compiled row: the eager row's model

    def rate(self, rows: int) -> float | None:
        return next((r.tokens_per_s for r in self.rows if r.rows == rows), None)


@dataclass(frozen=True)
class LlamaCppDecode:
    decode_s_per_token: Timing  # llama-bench tg, 2 threads
    prefill_tps: float  # llama-bench pp
    server_rows: tuple[RowsRate, ...]  # llama-server, requests decoding at once
    bench_peak_rss: int | None = None  # llama-bench's own peak RSS, the largest over its trials
    model_bytes: int | None = None  # its weights, as llama-bench counts them
    server_load: LoadCost | None = None  # llama-server: start to /health, RSS then, its peak

    def rate(self, rows: int) -> float | None:
        return next((r.tokens_per_s for r in self.server_rows if r.rows == rows), None)


@dataclass(frozen=True)
class DecodeResult:
    context: int  # prompt tokens before decoding
    new_tokens: int
    prefill_tokens: int
    trials: int
    precisions: tuple[PrecisionDecode, ...]
    llama_cpp: LlamaCppDecode | None
    model: str = ""  # what was loaded (the file's name)
    n_params: int | None = None
    file_bytes: int | None = None  # the GGUF's size, for a GGUF
    # kvchat's process over the whole run (VmHWM): every precision loaded, engines and requests
    peak_rss: int | None = None
    rss_start: int | None = None  # before the first load: Python, torch and kvchat imported

    @property
    def loaded_together(self) -> bool:
        """More than one precision was resident at once: per-row RSS includes the rows above."""
        return sum(p.load is not None for p in self.precisions) > 1

    def vs_llama(self, precision: str) -> float | None:
        """kvchat's one-stream ms/token over llama.cpp's: below 1 when kvchat is faster."""
        mine = next((p for p in self.precisions if p.precision == precision), None)
        if mine is None or self.llama_cpp is None:
            return None
        return mine.decode_s_per_token.median_s / self.llama_cpp.decode_s_per_token.median_s

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = as_json(self, "ms")
        out["vs_llama_cpp"] = {p.precision: self.vs_llama(p.precision) for p in self.precisions}
        out["loaded_together"] = self.loaded_together
        for p, entry in zip(self.precisions, out["precisions"], strict=True):
            if p.load is not None:
                entry["load"]["added"] = p.load.added
        return out
