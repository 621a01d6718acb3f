"""`kvchat bench decode`'s table: decode at each precision next to llama.cpp on the same file.
A pure function of the typed result (kvchat.bench.results.DecodeResult)."""

from __future__ import annotations

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvchat.bench.results import DecodeResult, PrecisionDecode, Timing

TARGET = 1.5  # one-stream ms/token at most 1.5x llama.cpp's on the same GGUF


def _ms(t: Timing) -> str:
    return f"{t.median_ms:.2f} ms [dim]±{t.spread:.0%}[/dim]"


def _rate(x: float | None) -> str:
    return "–" if x is None else f"{x:,.1f}"


def _mib(n: int | None) -> str:
    return "–" if n is None else f"{n / 2**20:,.0f} MiB"


def _title(r: DecodeResult) -> str:
    about = []
    if r.n_params:
        about.append(f"{r.n_params / 1e9:.2f} B parameters" if r.n_params >= 1e8
                     else f"{r.n_params / 1e6:.1f} M parameters")
    if r.file_bytes is not None:
        about.append(f"{_mib(r.file_bytes)} file")
    model = f"{r.model} ({', '.join(about)}), " if r.model else ""
    return (f"Decode: {model}{r.context}-token prompts, {r.new_tokens} new tokens, "
            f"medians of {r.trials}")


def _kvchat_row(r: DecodeResult, p: PrecisionDecode, rows: list[int], first: bool) -> list[str]:
    load = p.load
    if load is None:  # a compiled row: the eager row's model
        memory = ["", "", ""]
    else:
        rss = _mib(load.rss_after)
        if r.loaded_together and load.added is not None and not first:
            rss += f" (+{load.added / 2**20:,.0f})"
        # the run's peak is this precision's only when no other was loaded beside it
        memory = [f"{load.seconds:.1f} s", rss, "–" if r.loaded_together else _mib(r.peak_rss)]
    return [f"kvchat {p.precision}", f"{p.step_bytes / 2**20:,.1f} MiB", *memory,
            _ms(p.decode_s_per_token), *[_rate(p.rate(n)) for n in rows],
            f"{p.prefill_tps:,.0f}",
            f"{p.repeat_forwards_per_token:.2f} ({p.repeat_s_per_token * 1e3:.2f} ms/tok)"]


def decode_table(r: DecodeResult) -> RenderableType:
    rows = sorted({n.rows for p in r.precisions for n in p.rows})
    t = Table(title=_title(r), box=box.SIMPLE_HEAD, collapse_padding=True)
    t.add_column("runner")
    t.add_column("weights / step", justify="right")
    t.add_column("load", justify="right")
    t.add_column("RSS loaded", justify="right")
    t.add_column("peak RSS", justify="right")
    t.add_column("1 stream ms/tok", justify="right")
    for n in rows:
        t.add_column(f"{n} row{'s' if n > 1 else ''} tok/s", justify="right")
    t.add_column(f"prefill {r.prefill_tokens} tok/s", justify="right")
    t.add_column("repeat: forwards/tok", justify="right")
    loads = [p for p in r.precisions if p.load is not None]
    for p in r.precisions:
        t.add_row(*_kvchat_row(r, p, rows, first=bool(loads) and p is loads[0]))
    lines: list[RenderableType] = [t]
    if r.loaded_together:
        lines.append(Text(f"kvchat held every precision in one process: {_mib(r.rss_start)} "
                          f"resident before the first load, peak {_mib(r.peak_rss)} over the "
                          "run; each row's RSS includes the rows above it (+MiB: what its "
                          "load added).", style="dim"))
    elif r.rss_start is not None:
        lines.append(Text(f"kvchat's process held {_mib(r.rss_start)} before the load (Python, "
                          "torch, kvchat).", style="dim"))
    peer = r.llama_cpp
    if peer is not None:
        no_rows = ["–"] * len(rows)
        weights = "" if peer.model_bytes is None else f"{peer.model_bytes / 2**20:,.1f} MiB"
        t.add_row("llama.cpp llama-bench", weights, "", "", _mib(peer.bench_peak_rss),
                  _ms(peer.decode_s_per_token), *no_rows, f"{peer.prefill_tps:,.0f}", "")
        served = peer.server_load
        t.add_row("llama.cpp llama-server", "",
                  "–" if served is None else f"{served.seconds:.1f} s",
                  _mib(None if served is None else served.rss_after),
                  _mib(None if served is None else served.peak), "",
                  *[_rate(peer.rate(n)) for n in rows], "", "")
        for p in r.precisions:
            ratio = r.vs_llama(p.precision)
            if ratio is not None:
                style = "green" if ratio <= TARGET else "red"
                lines.append(Text(f"kvchat {p.precision} one stream: {ratio:.2f}x llama.cpp's "
                                  f"ms/token (target ≤ {TARGET}x)", style=style))
    t.caption = ("load: kvchat's load_model in its running process (the GGUF's config and "
                 "tokenizer converted beforehand); llama-server: its start to /health "
                 "answering. RSS: resident memory (VmRSS) once loaded, and the run's high-water "
                 "mark (VmHWM; llama-bench's watched while it runs). rows: fresh prompts decoding "
                 "together, timed once all are prefilled (llama-server: the requests' own "
                 "decode rates, summed); repeat: a greedy request asked again, its reply "
                 "drafted from the cache.")
    return Group(*lines)
