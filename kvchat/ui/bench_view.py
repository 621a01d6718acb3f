"""Rich tables (and optional matplotlib plots) for `kvchat bench` results: pure functions of the
typed results the benches return. Every time is printed by `format_seconds`.

The results are kvchat.bench.results types, or, for the engine benches, anything with the fields
of the Protocols below: a view never imports a bench.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvchat.bench.results import (
    GENERATE,
    PREFILL_TARGET,
    BatchBench,
    BatchSuite,
    CacheBenchResult,
    Contender,
    PolicyRow,
    Timing,
    format_seconds,
)
from kvchat.errors import KvchatError


class TTFTFigures(Protocol):
    """One prompt length of `kvchat bench ttft`."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def cold(self) -> Timing: ...
    @property
    def warm(self) -> Timing: ...
    @property
    def exact(self) -> Timing: ...
    @property
    def decode_step(self) -> Timing: ...
    @property
    def warm_vs_decode(self) -> float: ...
    @property
    def exact_vs_decode(self) -> float: ...


class OverheadFigures(Protocol):
    """`kvchat bench overhead`."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def new_tokens(self) -> int: ...
    @property
    def miss_cache_on(self) -> Timing: ...
    @property
    def miss_cache_off(self) -> Timing: ...
    @property
    def kvchat_decode_tps(self) -> float: ...
    @property
    def generate_decode_tps(self) -> float: ...
    @property
    def miss_overhead(self) -> float: ...
    @property
    def decode_ratio(self) -> float: ...
    @property
    def h2o_prefill_ratio(self) -> float | None: ...


class TurnFigures(Protocol):
    """One turn of `kvchat bench multiturn` (times in ms)."""

    @property
    def turn(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def hit_tokens(self) -> int: ...
    @property
    def hit_rate(self) -> float: ...
    @property
    def ttft_on(self) -> float: ...
    @property
    def ttft_off(self) -> float: ...


def _time(t: Timing) -> str:
    """Median with the spread of the trials as ± half their range, relative to the median."""
    return f"{format_seconds(t.median_s)} [dim]±{t.spread:.0%}[/dim]"


def _ratio(x: float | None, good: bool | None = None) -> Text:
    if x is None:
        return Text("–")
    style = "" if good is None else ("green" if good else "red")
    return Text(f"{x:.2f}x", style=style)


def _spread(*ts: Timing) -> str:
    return f"{max(t.spread for t in ts):.0%}"


def ttft_table(rows: Sequence[TTFTFigures]) -> Table:
    t = Table(title="Time to first token (medians)", box=box.SIMPLE_HEAD,
              collapse_padding=True)
    for col in ("prompt", "cold", "warm", "exact", "1 step", "warm/step", "exact/step", "±"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            f"{r.prompt_tokens:,}",
            format_seconds(r.cold.median_s),
            format_seconds(r.warm.median_s),
            format_seconds(r.exact.median_s),
            format_seconds(r.decode_step.median_s),
            _ratio(r.warm_vs_decode, r.warm_vs_decode <= 1.25),
            _ratio(r.exact_vs_decode, r.exact_vs_decode <= 0.3),
            _spread(r.cold, r.warm, r.exact, r.decode_step),
        )
    t.caption = ("warm: a hit on all but the last prompt token; exact: a repeat answered from "
                 "stored logits, no forward; 1 step: one decode step at that context; ±: the "
                 "widest half-range of the trials. Targets: warm ≤ 1.25x, exact ≤ 0.3x one step.")
    return t


def overhead_table(r: OverheadFigures) -> Table:
    t = Table(title="Cost of the cache when it cannot help", box=box.SIMPLE_HEAD)
    t.add_column("measure")
    t.add_column("cache on", justify="right")
    t.add_column("cache off / baseline", justify="right")
    t.add_column("ratio", justify="right")
    t.add_row(f"miss: {r.prompt_tokens}-token prompt + {r.new_tokens} tokens",
              _time(r.miss_cache_on), _time(r.miss_cache_off),
              _ratio(1 + r.miss_overhead, r.miss_overhead <= 0.03))
    t.add_row("decode tokens/s (kvchat vs model.generate)", f"{r.kvchat_decode_tps:.2f}",
              f"{r.generate_decode_tps:.2f}", _ratio(r.decode_ratio, r.decode_ratio >= 0.97))
    if r.h2o_prefill_ratio is not None:
        t.add_row(f"miss TTFT, {r.prompt_tokens} tokens: h2o's attention vs the default",
                  "", "", _ratio(r.h2o_prefill_ratio))
    t.caption = ("ratio: median of paired trials (order alternating). Targets: a miss ≤ 1.03x "
                 "with the cache on; decode ≥ 0.97x model.generate.")
    return t


def _batch_cells(r: BatchBench, c: Contender, peers: Sequence[str]) -> list[RenderableType]:
    reuse = r.reuse(c.name)
    same = r.identical(c.name)
    return [
        c.name,
        "–" if c.seconds is None else format_seconds(c.seconds),
        *[_ratio(r.speedup(peer, c.name)) if peer != c.name else Text("") for peer in peers],
        "–" if c.prefill_tokens is None else f"{c.prefill_tokens:,}",
        "" if reuse is None else f"{reuse:.1%}",
        "ref." if c.name == GENERATE and c.outputs else
        "–" if same is None else
        Text(f"{same}/{r.requests}", style="green" if same == r.requests else "red"),
    ]


def _settings(name: str, by_note: dict[str, list[str]], n_kinds: int) -> str:
    """One line per runner: its settings, and per kind where they differ (an automatic size)."""
    if len(by_note) == 1 and len(next(iter(by_note.values()))) == n_kinds:
        return f"{name}: {next(iter(by_note))}"
    return f"{name}: " + "; ".join(f"{', '.join(kinds)}: {note}" for note, kinds in by_note.items())


def batch_table(suite: BatchSuite) -> RenderableType:
    """One row per runner per workload kind: wall time, speed-up of the row's runner over each
    peer, prefill computed, kvchat's reuse against the ideal, outputs identical to generate;
    then the ideal row: what a perfect prefix cache computes and hits."""
    threads = f", {suite.torch_threads} torch threads" if suite.torch_threads else ""
    t = Table(title=f"Batch workloads, {suite.new_tokens} new tokens per request, greedy{threads}",
              box=box.SIMPLE_HEAD)
    t.add_column("kind")
    t.add_column("runner")
    t.add_column("wall", justify="right")
    peers = suite.peers
    for peer in peers:
        name = peer.removeprefix("model.")
        t.add_column(f"vs\n{name}", justify="right")
    for col in ("prefill\ncomputed", "reuse", "identical"):
        t.add_column(col, justify="right")
    notes: dict[str, dict[str, list[str]]] = {}  # runner -> its settings -> kinds run so
    for r in suite.kinds:
        t.add_section()
        about = [r.kind, f"{r.requests} lines", f"{r.prompt_tokens:,} tok"]
        rows = [_batch_cells(r, c, peers) for c in r.contenders]
        rows.append([Text("ideal", style="dim"), "", *["" for _ in peers],
                     Text(f"{r.ideal_prefill:,}", style="dim"),
                     Text(f"{r.ideal_hits:,}", style="dim"), ""])
        for i, cells in enumerate(rows):
            # the kind's facts, one a row; the last row takes what is left
            facts = about[i:] if i == len(rows) - 1 else about[i:i + 1]
            t.add_row(Text("\n".join(facts), style="" if i == 0 else "dim"), *cells)
        for c in r.contenders:
            if c.note:
                notes.setdefault(c.name, {}).setdefault(c.note, []).append(r.kind)
    t.caption = ("vs <peer>: the peer's wall time over the row's. reuse: cache-hit tokens over "
                 "the ideal's (per line, its longest prefix shared with any earlier line; over "
                 "100% where cached generated tokens match a later prompt). identical: lines "
                 "whose greedy tokens equal model.generate's (ref.). ideal: the prefill and "
                 "cache-hit tokens of a perfect prefix cache.")
    settings = Text("\n".join(_settings(name, by_note, len(suite.kinds))
                              for name, by_note in notes.items()), style="dim")
    return Group(t, settings)


def multiturn_table(rows: Sequence[TurnFigures]) -> Table:
    t = Table(title="Multi-turn chat: each turn extends the session's history",
              box=box.SIMPLE_HEAD)
    for col in ("turn", "prompt", "hit", "hit rate", "TTFT on", "TTFT off", "off / on"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r.turn), f"{r.prompt_tokens:,}", f"{r.hit_tokens:,}", f"{r.hit_rate:.1%}",
                  format_seconds(r.ttft_on / 1e3), format_seconds(r.ttft_off / 1e3),
                  _ratio(r.ttft_off / r.ttft_on if r.ttft_on else None))
    return t


def policies_table(rows: Sequence[PolicyRow]) -> Table:
    t = Table(title="Eviction policies on a workload bigger than the pool", box=box.SIMPLE_HEAD)
    for col in ("policy", "requests", "prompt tokens", "hit tokens", "hit rate",
                "requests with a hit", "evictions", "H2O scores"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r.policy, str(r.requests), f"{r.prompt_tokens:,}", f"{r.hit_tokens:,}",
                  f"{r.hit_rate:.1%}", str(r.requests_hit), f"{r.evictions:,}", r.scores)
    return t


# ---- bench cache ---------------------------------------------------------------------------


def _cell(t: Timing) -> Text:
    text = Text(format_seconds(t.median_s))
    text.append(f"\n{format_seconds(t.min_s)}–{format_seconds(t.max_s)}", style="dim")
    return text


def render_cache_bench(result: CacheBenchResult) -> RenderableType:
    """Two tables and the ratios they back; a pure function of the result."""
    lengths = [lk.prompt_tokens for lk in result.tree[0].lookups] if result.tree else []
    tree = Table(
        title=f"Cache operations vs cache size (block size {result.block_size}, "
        f"{result.policy}; median, min–max of {result.trials})",
        title_justify="left",
    )
    tree.add_column("cached blocks", justify="right")
    tree.add_column("nodes / leaves\n(on path, siblings)", justify="right")
    for n in lengths:
        tree.add_column(f"lookup {n:,}", justify="right")
    tree.add_column(f"store {result.prompt_tokens:,}", justify="right")
    tree.add_column("evict / block", justify="right")
    for row in result.tree:
        tree.add_row(
            f"{row.cached_blocks:,}",
            f"{row.tree_nodes:,} / {row.tree_leaves:,}\n"
            f"({row.path_nodes:,}, {row.max_siblings:,})",
            *[_cell(lk.timing) for lk in row.lookups],
            _cell(row.store),
            _cell(row.evict_per_block),
        )
    notes = Text()
    if result.tree:
        last = result.tree[-1]
        per_token = ", ".join(
            f"{lk.ns_per_token:.0f} ns ({lk.prompt_tokens:,})" for lk in last.lookups
        )
        notes.append(f"Lookup per prompt token at {last.cached_blocks:,} blocks: {per_token}\n")
        notes.append(
            f"Lookup of {result.prompt_tokens:,} tokens at {last.cached_blocks:,} vs "
            f"{result.tree[0].cached_blocks:,} cached blocks: {result.lookup_size_ratio:.2f}x\n"
        )

    bw = result.bandwidth
    band = Table(
        title=f"K/V traffic for {bw.tokens:,} tokens ({bw.n_layers} layers x {bw.n_kv_heads} "
        f"KV heads x {bw.head_dim}, {bw.dtype}, {bw.device}: {bw.kv_bytes / 2**20:.1f} MiB)",
        title_justify="left",
    )
    band.add_column("operation")
    band.add_column("time", justify="right")
    band.add_column("GB/s", justify="right")
    band.add_column("vs memcpy", justify="right")
    band.add_row("gather (pool -> K/V)", _cell(bw.gather), f"{bw.gather_gb_s:.1f}",
                 f"{bw.gather_gb_s / bw.memcpy_gb_s:.2f}x")
    band.add_row("store (K/V -> pool)", _cell(bw.store), f"{bw.store_gb_s:.1f}",
                 f"{bw.store_gb_s / bw.memcpy_gb_s:.2f}x")
    band.add_row("memcpy (clone)", _cell(bw.memcpy), f"{bw.memcpy_gb_s:.1f}", "1.00x")
    band.add_row("copy_ (preallocated)", _cell(bw.copy), f"{bw.copy_gb_s:.1f}",
                 f"{bw.copy_gb_s / bw.memcpy_gb_s:.2f}x")
    if bw.prefill is not None:
        band.add_row(f"prefill {bw.tokens:,} tokens", _cell(bw.prefill), "", "")
    if bw.gather_vs_prefill is not None and bw.store_vs_prefill is not None:
        ok = bw.gather_vs_prefill < PREFILL_TARGET
        notes.append(
            f"gather / prefill = {bw.gather_vs_prefill:.2%} (target < {PREFILL_TARGET:.0%}: "
            f"{'met' if ok else 'missed'}); store / prefill = {bw.store_vs_prefill:.2%}",
            style="green" if ok else "red",
        )
    else:
        notes.append("gather / prefill: no model given", style="dim")
    return Group(tree, band, notes)


# ---- plots ---------------------------------------------------------------------------------


def _pyplot():  # type: ignore[no-untyped-def]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise KvchatError(
            "Plots need matplotlib: pip install 'kvchat[plot]' (or pip install matplotlib)."
        ) from exc
    return plt


def plot_ttft(rows: Sequence[TTFTFigures], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r.prompt_tokens for r in rows]
    for label, key in (("cold", "cold"), ("warm hit", "warm"), ("exact repeat", "exact"),
                       ("1 decode step", "decode_step")):
        ax.plot(xs, [getattr(r, key).median_ms for r in rows], marker="o", label=label)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms (median)")
    ax.set_yscale("log")
    ax.set_title("kvchat: time to first token")
    ax.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_multiturn(rows: Sequence[TurnFigures], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r.turn for r in rows]
    ax.plot(xs, [r.ttft_off for r in rows], marker="o", label="cache off")
    ax.plot(xs, [r.ttft_on for r in rows], marker="o", label="cache on")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("kvchat: multi-turn chat")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_policies(rows: Sequence[PolicyRow], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([r.policy for r in rows], [100 * r.hit_rate for r in rows])
    ax.set_ylabel("token hit rate (%)")
    ax.set_title("kvchat: eviction policies under pressure")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- bench tiers ---------------------------------------------------------------------------


class TiersFigures(Protocol):
    """`kvchat bench tiers` (kvchat.bench.tiers.TiersResult)."""

    @property
    def small_tokens(self) -> int: ...
    @property
    def large_tokens(self) -> int: ...
    @property
    def save_small(self) -> Timing: ...
    @property
    def save_large(self) -> Timing: ...
    @property
    def open_empty(self) -> Timing: ...
    @property
    def open_large(self) -> Timing: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def ttft_cold(self) -> Timing: ...
    @property
    def ttft_memory(self) -> Timing: ...
    @property
    def ttft_disk(self) -> Timing: ...
    @property
    def pool_tokens(self) -> int: ...
    @property
    def distinct_prefix_tokens(self) -> int: ...
    @property
    def hit_rate_tier(self) -> float: ...
    @property
    def hit_rate_no_tier(self) -> float: ...
    @property
    def save_ratio(self) -> float: ...
    @property
    def open_ratio(self) -> float: ...
    @property
    def disk_vs_memory(self) -> float: ...
    @property
    def cold_vs_disk(self) -> float: ...


def tiers_table(r: TiersFigures) -> Table:
    """The disk tier's costs and gains, each line against its target."""
    t = Table(title="Disk tier (medians)", box=box.SIMPLE_HEAD)
    for name in ("measure", "baseline", "with the tier", "ratio", "target"):
        t.add_column(name, justify="left" if name == "measure" else "right")
    t.add_row("save after one turn", f"{r.small_tokens:,} tok: {_time(r.save_small)}",
              f"{r.large_tokens:,} tok: {_time(r.save_large)}",
              _ratio(r.save_ratio, r.save_ratio <= 2), "≤ 2x")
    t.add_row("start-up (runtime open)", f"empty: {_time(r.open_empty)}",
              f"{r.large_tokens:,} tok: {_time(r.open_large)}",
              _ratio(r.open_ratio, r.open_ratio <= 1.5), "≤ 1.5x")
    t.add_row(f"TTFT {r.prompt_tokens:,}-tok prompt, disk vs memory hit",
              f"memory: {_time(r.ttft_memory)}", f"disk: {_time(r.ttft_disk)}",
              _ratio(r.disk_vs_memory, r.disk_vs_memory <= 3), "≤ 3x")
    t.add_row("TTFT, cold vs disk hit", f"cold: {_time(r.ttft_cold)}",
              f"disk: {_time(r.ttft_disk)}", _ratio(r.cold_vs_disk, r.cold_vs_disk >= 5),
              "≥ 5x faster")
    t.add_row(f"token hit rate, prefixes {r.distinct_prefix_tokens:,} tok over a "
              f"{r.pool_tokens:,}-tok pool", f"no tier: {r.hit_rate_no_tier:.1%}",
              f"tier: {r.hit_rate_tier:.1%}", Text("–"), "higher")
    return t
