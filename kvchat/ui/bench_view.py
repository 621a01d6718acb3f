"""Rich tables (and optional matplotlib plots) for `kvchat bench` results: pure functions of the
typed results the bench modules return."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.bench.batch import BatchBench
    from kvchat.bench.engine import OverheadResult, Timing, TTFTRow, TurnRow
    from kvchat.bench.policies import PolicyRow


def _ms(t: Timing) -> str:
    """Median with the spread of the trials as ± half their range, relative to the median."""
    spread = (t.max_ms - t.min_ms) / 2 / t.median_ms if t.median_ms else 0.0
    return f"{t.median_ms:,.1f} [dim]±{spread:.0%}[/dim]"


def _ratio(x: float | None, good: bool | None = None) -> Text:
    if x is None:
        return Text("–")
    style = "" if good is None else ("green" if good else "red")
    return Text(f"{x:.2f}x", style=style)


def _spread(*ts: Timing) -> str:
    return f"{max((t.max_ms - t.min_ms) / 2 / t.median_ms if t.median_ms else 0 for t in ts):.0%}"


def ttft_table(rows: Sequence[TTFTRow]) -> Table:
    t = Table(title="Time to first token (ms, medians)", box=box.SIMPLE_HEAD)
    for col in ("prompt", "cold", "warm hit", "exact", "1 step", "warm/step", "exact/step",
                "±"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            f"{r.prompt_tokens:,}",
            f"{r.cold.median_ms:,.1f}",
            f"{r.warm.median_ms:,.1f}",
            f"{r.exact.median_ms:,.2f}",
            f"{r.decode_step.median_ms:,.1f}",
            _ratio(r.warm_vs_decode, r.warm_vs_decode <= 1.25),
            _ratio(r.exact_vs_decode, r.exact_vs_decode <= 0.3),
            _spread(r.cold, r.warm, r.exact, r.decode_step),
        )
    t.caption = ("warm hit: all but the last prompt token cached; exact: a repeat answered from "
                 "stored logits, no forward; 1 step: one decode step at that context; ±: the "
                 "widest half-range of the trials. Targets: warm ≤ 1.25x, exact ≤ 0.3x one step.")
    return t


def overhead_table(r: OverheadResult) -> Table:
    t = Table(title="Cost of the cache when it cannot help", box=box.SIMPLE_HEAD)
    t.add_column("measure")
    t.add_column("cache on", justify="right")
    t.add_column("cache off / baseline", justify="right")
    t.add_column("ratio", justify="right")
    t.add_row(f"miss: {r.prompt_tokens}-token prompt + {r.new_tokens} tokens (ms)",
              _ms(r.miss_cache_on), _ms(r.miss_cache_off),
              _ratio(1 + r.miss_overhead, r.miss_overhead <= 0.03))
    t.add_row("decode tokens/s (kvchat vs model.generate)", f"{r.kvchat_decode_tps:.2f}",
              f"{r.generate_decode_tps:.2f}", _ratio(r.decode_ratio, r.decode_ratio >= 0.97))
    if r.h2o_prefill_ratio is not None:
        t.add_row(f"miss TTFT, {r.prompt_tokens} tokens: h2o's attention vs the default",
                  "", "", _ratio(r.h2o_prefill_ratio))
    t.caption = ("ratio: median of paired trials (order alternating). Targets: a miss ≤ 1.03x "
                 "with the cache on; decode ≥ 0.97x model.generate.")
    return t


def batch_table(r: BatchBench) -> RenderableType:
    t = Table(title=f"{r.requests} requests, {r.prompt_tokens:,} prompt tokens, "
                    f"{r.new_tokens} new tokens each", box=box.SIMPLE_HEAD)
    t.add_column("runner")
    t.add_column("wall s", justify="right")
    t.add_column("kvchat speed-up", justify="right")
    t.add_column("prefill tokens computed", justify="right")
    t.add_column("settings")
    kv = next((c for c in r.contenders if c.name == "kvchat"), None)
    for c in r.contenders:
        speed = r.speedup(c.name) if c.name != "kvchat" and kv else None
        t.add_row(
            c.name,
            "–" if c.seconds is None else f"{c.seconds:.2f}",
            _ratio(speed) if c.name != "kvchat" else Text(""),
            "–" if c.prefill_tokens is None else f"{c.prefill_tokens:,}",
            c.note,
        )
    lines: list[RenderableType] = [t]
    if kv and kv.prefill_tokens is not None:
        extra = kv.prefill_tokens / r.ideal_prefill - 1
        lines.append(Text(f"ideal prefill (each distinct prefix once): {r.ideal_prefill:,} "
                          f"tokens; kvchat computed {extra:+.1%} of that"))
    same = [c.name for c in r.contenders
            if c.name != "kvchat" and kv and c.outputs and c.outputs == kv.outputs]
    if same:
        lines.append(Text(f"greedy outputs identical to: {', '.join(same)}"))
    return Group(*lines)


def multiturn_table(rows: Sequence[TurnRow]) -> Table:
    t = Table(title="Multi-turn chat: each turn extends the session's history",
              box=box.SIMPLE_HEAD)
    for col in ("turn", "prompt", "hit", "hit rate", "TTFT on (ms)", "TTFT off (ms)", "off / on"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r.turn), f"{r.prompt_tokens:,}", f"{r.hit_tokens:,}", f"{r.hit_rate:.1%}",
                  f"{r.ttft_on:,.1f}", f"{r.ttft_off:,.1f}",
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


def plot_ttft(rows: Sequence[TTFTRow], path: Path) -> Path:
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


def plot_multiturn(rows: Sequence[TurnRow], path: Path) -> Path:
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
