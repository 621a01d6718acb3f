"""`kvchat bench decode`'s table: decode at each precision next to llama.cpp on the same file.
A pure function of the typed result (kvchat.bench.results.DecodeResult)."""

from __future__ import annotations

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvchat.bench.results import DecodeResult, Timing

TARGET = 1.5  # one-stream ms/token at most 1.5x llama.cpp's on the same GGUF


def _ms(t: Timing) -> str:
    return f"{t.median_ms:.2f} ms [dim]±{t.spread:.0%}[/dim]"


def _rate(x: float | None) -> str:
    return "–" if x is None else f"{x:,.1f}"


def decode_table(r: DecodeResult) -> RenderableType:
    rows = sorted({n.rows for p in r.precisions for n in p.rows})
    t = Table(title=f"Decode: {r.context}-token prompts, {r.new_tokens} new tokens, "
              f"medians of {r.trials}", box=box.SIMPLE_HEAD, collapse_padding=True)
    t.add_column("runner")
    t.add_column("weights / step", justify="right")
    t.add_column("1 stream ms/tok", justify="right")
    for n in rows:
        t.add_column(f"{n} row{'s' if n > 1 else ''} tok/s", justify="right")
    t.add_column(f"prefill {r.prefill_tokens} tok/s", justify="right")
    t.add_column("repeat: forwards/tok", justify="right")
    for p in r.precisions:
        t.add_row(f"kvchat {p.precision}", f"{p.step_bytes / 2**20:,.1f} MiB",
                  _ms(p.decode_s_per_token), *[_rate(p.rate(n)) for n in rows],
                  f"{p.prefill_tps:,.0f}",
                  f"{p.repeat_forwards_per_token:.2f} ({p.repeat_s_per_token * 1e3:.2f} ms/tok)")
    lines: list[RenderableType] = [t]
    peer = r.llama_cpp
    if peer is not None:
        t.add_row("llama.cpp (llama-bench; llama-server rows)", "", _ms(peer.decode_s_per_token),
                  *[_rate(peer.rate(n)) for n in rows], f"{peer.prefill_tps:,.0f}", "")
        for p in r.precisions:
            ratio = r.vs_llama(p.precision)
            if ratio is not None:
                style = "green" if ratio <= TARGET else "red"
                lines.append(Text(f"kvchat {p.precision} one stream: {ratio:.2f}x llama.cpp's "
                                  f"ms/token (target ≤ {TARGET}x)", style=style))
    t.caption = ("rows: fresh prompts decoding together, timed once all are prefilled "
                 "(llama-server: the requests' own decode rates, summed); repeat: a greedy "
                 "request asked again, its reply drafted from the cache.")
    return Group(*lines)
