"""`kvchat bench ...`: the measurements behind every performance claim in docs/performance.md.

Thin commands: parse options, load the model, call a bench function, render its typed result
(or print it as JSON). Heavy imports happen inside the commands so `kvchat --help` stays fast.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from kvchat.bench.workloads import KINDS

bench_app = typer.Typer(
    name="bench",
    help="Measure what the cache buys: each subcommand prints ratios measured within one run "
    "(medians of repeated trials after a warm-up). Add --json for machine-readable output.",
    no_args_is_help=True,
)

Model = Annotated[
    str | None,
    typer.Option("--model", "-m", help="HF hub id, local folder or .gguf (default: embedded "
                 "SmolLM2-135M-Instruct)."),
]
Dtype = Annotated[str | None, typer.Option(
    "--dtype", help="float32, bfloat16, float16, int8 or int4 (default: the model's own; see "
    "`kvchat models`).")]
Device = Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")]
Json = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
Trials = Annotated[int, typer.Option("--trials", min=1, help="Timed trials per figure.")]
Plot = Annotated[
    Path | None, typer.Option("--plot", help="Also save a plot (PNG; needs matplotlib).")
]


def _err() -> Console:
    return Console(stderr=True)


@contextmanager
def _status(title: str) -> Iterator[Callable[[str], None]]:
    console = _err()
    with console.status(title) as status:
        yield lambda msg: status.update(f"{title}: {msg}")


def _load(model: str | None, dtype: str | None, device: str) -> Any:
    from kvchat.models.loading import load_model

    return load_model(model, dtype=dtype, device=device)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{what} must be comma-separated integers, got {text!r}") \
            from None
    if not values or min(values) < 1:
        raise typer.BadParameter(f"{what} must be positive integers")
    return values


def _emit(result: Any, renderable: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2, default=str))
    else:
        Console().print(renderable)


@bench_app.command()
def ttft(
    lengths: Annotated[str, typer.Option(help="Prompt lengths, comma-separated.")] = (
        "128,512,1024,2048"
    ),
    trials: Trials = 5,
    model: Model = None,
    dtype: Dtype = None,
    device: Device = "auto",
    plot: Plot = None,
    as_json: Json = False,
) -> None:
    """Time to first token, cold vs warm full-prefix hit vs exact repeat, next to one decode
    step at the same context length."""
    from kvchat.bench.engine import as_dict, bench_ttft
    from kvchat.ui.bench_view import plot_ttft, ttft_table

    sizes = _ints(lengths, "--lengths")
    lm = _load(model, dtype, device)
    with _status("bench ttft") as progress:
        rows = bench_ttft(lm.model, lm.tokenizer, sizes, trials=trials, progress=progress)
    _emit(as_dict(rows), ttft_table(rows), as_json)
    if plot:
        _err().print(f"plot: {plot_ttft(rows, plot)}")


@bench_app.command()
def overhead(
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Prompt length of each miss.")] = 512,
    new_tokens: Annotated[int, typer.Option(min=2, help="Tokens decoded per request.")] = 32,
    trials: Trials = 5,
    model: Model = None,
    dtype: Dtype = None,
    device: Device = "auto",
    as_json: Json = False,
) -> None:
    """What the cache costs when it cannot help: a miss with the cache on vs off, and decode
    tokens/s vs plain model.generate."""
    from kvchat.bench.engine import as_dict, bench_overhead
    from kvchat.ui.bench_view import overhead_table

    lm = _load(model, dtype, device)
    with _status("bench overhead") as progress:
        res = bench_overhead(lm.model, lm.tokenizer, prompt_tokens, new_tokens, trials,
                             progress=progress)
    _emit(as_dict(res), overhead_table(res), as_json)


@bench_app.command()
def cache(
    sizes: Annotated[str, typer.Option(help="Cached blocks to measure at, comma-separated.")] = (
        "1000,10000,100000"
    ),
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Looked-up prompt length.")] = 4096,
    trials: Annotated[int, typer.Option(min=1)] = 15,
    with_model: Annotated[
        bool, typer.Option(help="Also time a 1,024-token prefill of the model for the "
                           "gather-vs-prefill ratio.")
    ] = True,
    model: Model = None,
    dtype: Dtype = None,
    device: Device = "auto",
    as_json: Json = False,
) -> None:
    """Lookup / store / evict costs vs prompt length and cache size, and gather/store
    bandwidth vs memcpy (and vs a prefill on the model)."""
    from kvchat.bench.cache import run_cache_bench
    from kvchat.ui.bench_view import render_cache_bench

    counts = _ints(sizes, "--sizes")
    lm = _load(model, dtype, device) if with_model else None
    with _status("bench cache") as progress:
        res = run_cache_bench(lm.model if lm else None, counts, prompt_tokens, trials=trials,
                              progress=progress)
    _emit(res.as_dict(), render_cache_bench(res), as_json)


@bench_app.command()
def batch(
    kind: Annotated[
        str, typer.Option(help="Workload: shared-system, few-shot, multi-turn, repeats, "
                          "unaligned, or all (the five in one run, one table).")
    ] = "shared-system",
    requests: Annotated[
        int, typer.Option(min=1, help="Requests in the shared-system workload.")
    ] = 32,
    system_tokens: Annotated[
        int, typer.Option(min=1, help="Shared system prompt length (shared-system).")
    ] = 600,
    new_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per request.")] = 16,
    batch_size: Annotated[
        int | None, typer.Option(min=1, help="Override kvchat's decode batch size (default: "
                                 "auto, as kvchat batch picks it).")
    ] = None,
    skip: Annotated[
        str, typer.Option(help="Runners to leave out: generate, generate_batch.")
    ] = "",
    llama_cpp: Annotated[Path | None, typer.Option(
        "--llama-cpp", help="llama.cpp build folder: add llama-server on the same GGUF (one "
        "request at a time, and 8 at once) as a peer.", file_okay=False)] = None,
    model: Model = None,
    dtype: Dtype = None,
    device: Device = "auto",
    as_json: Json = False,
) -> None:
    """Request files of five kinds through kvchat at its defaults vs plain model.generate per
    request vs transformers' generate_batch (continuous batching with block sharing): wall
    time, prefill computed, reuse against the ideal, identical greedy outputs."""
    from kvchat.bench.batch import bench_batch
    from kvchat.ui.bench_view import batch_table

    if kind != "all" and kind not in KINDS:
        raise typer.BadParameter(f"unknown --kind {kind!r}; choose one of "
                                 f"{', '.join(KINDS)} or all")
    left_out = {s.strip() for s in skip.split(",") if s.strip()}
    unknown = left_out - {"generate", "generate_batch"}
    if unknown:
        raise typer.BadParameter(f"unknown contender(s) in --skip: {', '.join(sorted(unknown))}")
    include = tuple(c for c in ("kvchat", "generate_batch", "generate") if c not in left_out)
    kinds = KINDS if kind == "all" else (kind,)
    lm = _load(model, dtype, device)
    llama = None
    if llama_cpp is not None:
        from kvchat.bench.llama_cpp import LlamaCpp

        if not lm.source.is_gguf:
            raise typer.BadParameter("--llama-cpp needs a GGUF model (the embedded one, or "
                                     "--model FILE.gguf)")
        llama = (LlamaCpp(llama_cpp), Path(lm.source.location))
    with _status("bench batch") as progress:
        res = bench_batch(lm.model, lm.tokenizer, kinds, new_tokens, batch_size, include,
                          requests, system_tokens, progress, llama)
    _emit(res.as_dict(), batch_table(res), as_json)


@bench_app.command()
def decode(
    precisions: Annotated[str, typer.Option(
        help="Precisions to load the model at, comma-separated.")] = "float32,bfloat16,int8,int4",
    rows: Annotated[str, typer.Option(help="Rows decoding together, comma-separated.")] = (
        "1,8,32,64"),
    context: Annotated[int, typer.Option(min=1, help="Prompt tokens before decoding.")] = 64,
    new_tokens: Annotated[int, typer.Option(min=2, help="Tokens decoded per request.")] = 64,
    prefill_tokens: Annotated[int, typer.Option(min=1, help="Prompt length of the prefill "
                                                "figure.")] = 512,
    trials: Trials = 3,
    llama_cpp: Annotated[Path | None, typer.Option(
        "--llama-cpp", help="llama.cpp build folder (with llama-bench and llama-server): run "
        "them on the same GGUF, interleaved with kvchat's trials.", file_okay=False)] = None,
    compile_too: Annotated[bool, typer.Option(
        "--compile", help="Also measure each precision with its decode steps compiled "
        "(kvchat's --compile; adds a compile of a minute or two per precision).")] = False,
    model: Model = None,
    device: Device = "auto",
    as_json: Json = False,
) -> None:
    """Decode at each precision: one stream's ms/token, rows x tokens/s, prefill tokens/s and
    the forwards a repeated request needs with drafts from the cache, the load's time and the
    resident memory after it and at the run's peak; with --llama-cpp, llama.cpp on the same
    GGUF in the same sitting (its load time, RSS and peak too)."""
    from kvchat.bench.decode import bench_decode
    from kvchat.bench.llama_cpp import LlamaCpp
    from kvchat.models.loading import resolve_model, weights_location
    from kvchat.models.precision import canonical
    from kvchat.ui.decode_view import decode_table

    names = [canonical(p) for p in precisions.split(",") if p.strip()]
    if not names:
        raise typer.BadParameter("--precisions names no precision")
    source = resolve_model(model)
    llama = LlamaCpp(llama_cpp) if llama_cpp is not None else None
    if llama is not None and not source.is_gguf:
        raise typer.BadParameter("--llama-cpp needs a GGUF model (the embedded one, or "
                                 "--model FILE.gguf)")
    gguf = Path(source.location) if source.is_gguf else None
    # a GGUF's first load also converts its config and tokenizer, once: not part of a load
    weights_location(source)
    label = gguf.name if gguf is not None else Path(source.location).name
    with _status("bench decode") as progress:
        res = bench_decode(lambda p: _load(model, p, device), names, _ints(rows, "--rows"),
                           context, new_tokens, prefill_tokens, trials, llama, gguf, progress,
                           compile_too, label)
    _emit(res.as_dict(), decode_table(res), as_json)


@bench_app.command()
def multiturn(
    turns: Annotated[int, typer.Option(min=1)] = 6,
    max_tokens: Annotated[int, typer.Option(min=1, help="Reply length per turn.")] = 32,
    system: Annotated[
        str, typer.Option(help="The chat's system prompt ('' for none). A long one, as apps "
                          "use, raises every turn's hit rate.")
    ] = "You are a friendly outdoor guide. Answer in two sentences.",
    model: Model = None,
    dtype: Dtype = None,
    device: Device = "auto",
    plot: Plot = None,
    as_json: Json = False,
) -> None:
    """A scripted chat: per-turn hit rate and time to first token, cache on vs off."""
    from kvchat.bench.engine import as_dict, bench_multiturn
    from kvchat.ui.bench_view import multiturn_table, plot_multiturn

    lm = _load(model, dtype, device)
    with _status("bench multiturn") as progress:
        rows = bench_multiturn(lm.model, lm.tokenizer, turns, max_tokens,
                               system=system or None, progress=progress)
    _emit(as_dict(rows), multiturn_table(rows), as_json)
    if plot:
        _err().print(f"plot: {plot_multiturn(rows, plot)}")


@bench_app.command()
def fleet(
    instances: Annotated[int, typer.Option(min=2, help="kvchat serve instances.")] = 2,
    kinds: Annotated[str, typer.Option(help="Workload kinds, comma-separated.")] = (
        "shared-system,multi-turn"),
    concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight at once.")] = 4,
    new_tokens: Annotated[int, typer.Option(min=1, help="Tokens generated per request.")] = 16,
    cache_mb: Annotated[float, typer.Option(min=1, help="Each instance's --cache-mb.")] = 512.0,
    model: Model = None,
    as_json: Json = False,
) -> None:
    """N kvchat serve instances behind sglang-router on loopback: the fleet's token hit rate
    and throughput with cache_aware vs round_robin routing, with and without a shared block
    tier, against one instance alone. Needs sglang-router (pip install sglang-router)."""
    from kvchat.bench.fleet import FleetConfig, bench_fleet
    from kvchat.bench.workloads import build_workload
    from kvchat.ui.fleet_view import fleet_table

    names = [k.strip() for k in kinds.split(",") if k.strip()]
    unknown = [k for k in names if k not in KINDS]
    if unknown or not names:
        raise typer.BadParameter(f"--kinds: unknown {', '.join(unknown) or '(none)'}; known: "
                                 f"{', '.join(KINDS)}")
    tokenizer = _load(model, None, "cpu").tokenizer  # the prompts, as the servers encode them
    workloads = {k: [tokenizer.decode(p) for p in build_workload(k, tokenizer)] for k in names}
    config = FleetConfig(model, instances, concurrency, new_tokens, cache_mb)
    with _status("bench fleet") as progress:
        result = bench_fleet(config, workloads, progress)
    _emit(result.as_dict(), fleet_table(result), as_json)


@bench_app.command()
def policies(
    requests: Annotated[int, typer.Option(min=1, help="Requests replayed.")] = 400,
    pool_fraction: Annotated[
        float, typer.Option(min=0.01, max=1.0, help="Pool size as a fraction of the "
                            "workload's distinct blocks.")
    ] = 0.25,
    with_model: Annotated[
        bool, typer.Option(help="Run every request through the model (real H2O attention "
                           "scores) instead of the token-level simulation.")
    ] = False,
    model: Model = None,
    dtype: Dtype = None,
    device: Device = "auto",
    plot: Plot = None,
    as_json: Json = False,
) -> None:
    """Replay a workload bigger than the pool under lru / sink-lru / h2o: hit rate and
    evictions per policy."""
    from kvchat.bench.engine import as_dict
    from kvchat.bench.policies import bench_policies
    from kvchat.ui.bench_view import plot_policies, policies_table

    lm = _load(model, dtype, device) if with_model else None
    with _status("bench policies") as progress:
        rows = bench_policies(requests, pool_fraction, model=lm.model if lm else None,
                              tokenizer=lm.tokenizer if lm else None, progress=progress)
    _emit(as_dict(rows), policies_table(rows), as_json)
    if plot:
        _err().print(f"plot: {plot_policies(rows, plot)}")


@bench_app.command()
def tiers(
    small: Annotated[int, typer.Option(min=1, help="Cached tokens of the small cache.")] = 1000,
    large: Annotated[int, typer.Option(min=1, help="Cached tokens of the large cache.")] = 20_000,
    prompt_tokens: Annotated[int, typer.Option(min=2, help="Prompt length for TTFT.")] = 1024,
    trials: Trials = 3,
    model: Model = None,
    dtype: Dtype = None,
    device: Device = "auto",
    as_json: Json = False,
) -> None:
    """The disk tier: save time after one turn with a small vs a large cache, start-up with a
    large saved cache vs none, time to first token from disk vs a memory hit vs cold, and the
    hit rate of prefixes that need 4x the pool with the tier and without."""
    from kvchat.bench.tiers import bench_tiers
    from kvchat.ui.bench_view import tiers_table

    lm = _load(model, dtype, device)
    with _status("bench tiers") as progress:
        res = bench_tiers(lm.model, lm.tokenizer, small, large, prompt_tokens, trials=trials,
                          progress=progress)
    _emit(res.to_json(), tiers_table(res), as_json)
