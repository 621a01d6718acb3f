"""`kvchat bench fleet` as a table: a pure function of its result."""

from __future__ import annotations

from rich import box
from rich.table import Table

from kvchat.bench.fleet_results import FleetBench


def fleet_table(bench: FleetBench) -> Table:
    threads = ", ".join(f"{t} for {n}" for n, t in sorted(bench.threads.items()))
    t = Table(title=f"A fleet behind {bench.router} ({bench.concurrency} requests at a time, "
              f"{bench.new_tokens} new tokens each; torch threads per instance: {threads})",
              box=box.SIMPLE_HEAD)
    for col in ("kind / setup", "prompt", "hit", "shared", "hit rate", "of 1", "req/s",
                "tok/s", "failed"):
        t.add_column(col, justify="left" if col == "kind / setup" else "right")
    kind = None
    for r in bench.runs:
        if r.kind != kind:
            kind = r.kind
            t.add_row(f"[bold]{kind}[/] ({r.requests} requests)")
        rel = bench.of_single(r)
        t.add_row(f"  {r.setup}", f"{r.prompt_tokens:,}", f"{r.hit_tokens:,}",
                  f"{r.shared_hit_tokens:,}" if r.shared else "—", f"{r.hit_rate:.1%}",
                  "—" if rel is None or r.instances == 1 else f"{rel:.1%}",
                  f"{r.requests_per_s:.2f}", f"{r.tokens_per_s:.1f}", str(r.failures))
    return t
