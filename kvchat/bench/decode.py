"""`kvchat bench decode`: decoding at each precision, against llama.cpp on the same GGUF.

Per precision (the model loaded at it, in one process):
- one stream: ms per token of a fresh prompt (no cache hit, nothing to draft);
- rows x tokens/s with 1, 8, 32 and 64 rows decoding together (fresh prompts, timed once every
  row has been prefilled);
- prefill tokens/s of a fresh 512-token prompt;
- a repeated greedy request: decode forwards per generated token (its reply drafted from the
  cache's copy of the first one's) and its ms per token.
- its load: the wall time of `load_model` and the process's resident memory (VmRSS) before and
  after it, and its high-water mark during it (VmHWM, reset just before). Every precision is
  loaded before any is timed, so with several, a later one's RSS includes the earlier ones':
  `added` is what each load left resident; the run's peak covers all of them at once.
llama.cpp (`--llama-cpp DIR`): llama-bench's prefill / decode rates on 2 threads, one repetition
between each of kvchat's one-stream trials (interleaved, so both see the same machine), and its
peak RSS (each run's own VmHWM, watched while it runs); a llama-server with 8 slots fed 1 and 8
requests at once for its rows x tokens/s, its load time (start to /health answering), its RSS
then and its peak.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvchat.bench.engine import random_prompt
from kvchat.bench.llama_cpp import LlamaCpp, memory_of, reset_peak, serve_requests
from kvchat.bench.results import (
    DecodeResult,
    LlamaCppDecode,
    LoadCost,
    PrecisionDecode,
    RowsRate,
    Timing,
)
from kvchat.config import CacheConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.sequence import Request

Progress = Callable[[str], None]


def _engine(loaded: Any, rows: int) -> Engine:
    return Engine.create(loaded.model, loaded.tokenizer, CacheConfig(16), batch_size=rows)


def _one_stream(engine: Engine, context: int, new: int, seed: int) -> float:
    """Seconds per decoded token of one fresh request."""
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    result = engine.generate(Request(random_prompt(engine, context, seed), params))
    return 1.0 / result.decode_tokens_per_s


def _rows_rate(engine: Engine, rows: int, context: int, new: int, seed: int) -> float:
    """Tokens per second over every row, from the step after the last row was admitted."""
    import time

    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    handles = [engine.submit(Request(random_prompt(engine, context, seed + i), params))
               for i in range(rows)]
    while engine.waiting or any(not h.seq.generated for h in handles):
        engine.step()
    before = sum(len(h.seq.generated) for h in handles)
    started = time.perf_counter()
    while not engine.idle:
        engine.step()
    return (rows * new - before) / (time.perf_counter() - started)


def _prefill_rate(engine: Engine, tokens: int, seed: int) -> float:
    result = engine.generate(Request(random_prompt(engine, tokens, seed),
                                     SamplingParams(max_new_tokens=1)))
    return tokens / (result.prefill_ms / 1000)


def _repeat(engine: Engine, context: int, new: int, seed: int) -> tuple[float, float]:
    """(decode forwards per generated token, seconds per token) of a repeated greedy request
    that drafts its stored reply: replaying it (`engine/replay.py`) would run no forward at
    all, with no rate to measure."""
    ids = random_prompt(engine, context, seed)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    engine.generate(Request(ids, params))
    replay, engine.replay = engine.replay, False
    try:
        again = engine.generate(Request(ids, params))
    finally:
        engine.replay = replay
    return again.decode_forwards / len(again.token_ids), 1.0 / again.decode_tokens_per_s


def _timed_load(load: Callable[[str], Any], precision: str) -> tuple[Any, LoadCost]:
    """The model at `precision`, its load's wall time and this process's memory around it."""
    before = memory_of()
    peak_reset = reset_peak()
    started = time.perf_counter()
    model = load(precision)
    seconds = time.perf_counter() - started
    after = memory_of()
    return model, LoadCost(seconds, None if before is None else before[0],
                           None if after is None else after[0],
                           after[1] if after is not None and peak_reset else None)


def bench_decode(
    load: Callable[[str], Any], precisions: Sequence[str], rows: Sequence[int], context: int,
    new_tokens: int, prefill_tokens: int, trials: int, llama: LlamaCpp | None, gguf: Path | None,
    progress: Progress | None = None, compile_too: bool = False, label: str = "",
) -> DecodeResult:
    """`load(precision)` gives a loaded model (kvchat.models.loading.LoadedModel) at that precision;
    `compile_too` adds, per precision, the same figures with decode steps compiled
    (`ModelRunner.compile_decode`), measured after the eager ones."""
    say = progress or (lambda _: None)
    start = memory_of()
    loaded, costs = {}, {}
    for p in precisions:
        say(f"loading at {p}")
        loaded[p], costs[p] = _timed_load(load, p)
    first = loaded[precisions[0]]
    engines = {p: _engine(m, max(rows)) for p, m in loaded.items()}
    for p, engine in engines.items():  # first calls pay one-time costs: not timed
        say(f"{p}: warm-up")
        _one_stream(engine, context, 4, seed=1)
    single: dict[str, list[float]] = {p: [] for p in precisions}
    llama_runs = []
    for trial in range(trials):
        for p, engine in engines.items():
            say(f"one stream, trial {trial + 1}/{trials}: {p}")
            single[p].append(_one_stream(engine, context, new_tokens, seed=100 + trial))
        if llama is not None and gguf is not None:
            say(f"one stream, trial {trial + 1}/{trials}: llama-bench")
            llama_runs.append(llama.bench(gguf, prefill_tokens, new_tokens))
    figures = []
    for p, engine in engines.items():
        rates = []
        for n in rows:
            say(f"{p}: {n} rows")
            rates.append(RowsRate(n, _rows_rate(engine, n, context, new_tokens, seed=1000 * n)))
        say(f"{p}: prefill and a repeated request")
        prefill = [_prefill_rate(engine, prefill_tokens, seed=50 + t) for t in range(trials)]
        forwards, repeat_s = _repeat(engine, context, new_tokens, seed=7)
        figures.append(PrecisionDecode(
            p, loaded[p].step_bytes, Timing.of(single[p]), tuple(rates),
            sorted(prefill)[len(prefill) // 2], forwards, repeat_s, costs[p]))
        if compile_too:
            figures.append(_compiled(engine, figures[-1], rows, context, new_tokens, trials, say))
    peak = _run_peak(list(costs.values()))
    n_params = first.facts.n_params
    del engines, loaded, first
    gc.collect()
    peer = None
    if llama is not None and gguf is not None:
        say("llama-server: 1 and 8 requests at once")
        peer = _llama_peer(llama, gguf, llama_runs, context, new_tokens)
    return DecodeResult(context, new_tokens, prefill_tokens, trials, tuple(figures), peer,
                        label, n_params, gguf.stat().st_size if gguf is not None else None,
                        peak, None if start is None else start[0])


def _run_peak(loads: Sequence[LoadCost]) -> int | None:
    """This process's high-water mark since the first load: the last reset was just before the
    last load, so VmHWM now covers that load and everything after it; the loads before it each
    read their own. None where the high-water mark could not be reset."""
    now = memory_of()
    if now is None or any(c.peak is None for c in loads):
        return None
    return max([now[1], *(c.peak for c in loads if c.peak is not None)])


def _compiled(engine: Engine, eager: PrecisionDecode, rows: Sequence[int], context: int,
              new: int, trials: int, say: Progress) -> PrecisionDecode:
    """The engine's precision again with its decode steps compiled: one stream and rows."""
    say(f"{eager.precision}: compiling the decode step")
    engine.runner.compile_decode()
    engine.warm_up()
    for n in rows:  # each batch size's graph is compiled before it is timed
        _rows_rate(engine, n, context, 4, seed=7000 + n)
    say(f"{eager.precision} compiled: one stream and rows")
    single = Timing.of([_one_stream(engine, context, new, seed=200 + t) for t in range(trials)])
    rates = tuple(RowsRate(n, _rows_rate(engine, n, context, new, seed=2000 * n)) for n in rows)
    return PrecisionDecode(f"{eager.precision} compiled", eager.step_bytes, single, rates,
                           eager.prefill_tps, eager.repeat_forwards_per_token,
                           eager.repeat_s_per_token, None)


def _llama_peer(llama: LlamaCpp, gguf: Path, runs: Sequence[Any], context: int,
                new: int) -> LlamaCppDecode:
    import random

    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40_000) for _ in range(context)] for _ in range(9)]
    with llama.serve(gguf, parallel=8) as server:
        serve_requests(server.url, prompts[8:], 4, 1)  # warm-up
        one = serve_requests(server.url, prompts[:1], new, 1)
        eight = serve_requests(server.url, prompts[1:9], new, 8)
        started = server.started
        load = LoadCost(started.seconds, None, started.rss_after, server.peak_rss())
    peaks = [r.peak_rss for r in runs if r.peak_rss is not None]
    return LlamaCppDecode(
        decode_s_per_token=Timing.of([1.0 / r.decode_tps for r in runs]),
        prefill_tps=sorted(r.prefill_tps for r in runs)[len(runs) // 2],
        # each request's own decode rate, summed over the 8 that decode together
        server_rows=(RowsRate(1, one.decode_tps), RowsRate(8, eight.decode_tps)),
        bench_peak_rss=max(peaks) if peaks else None,
        model_bytes=next((r.model_bytes for r in runs if r.model_bytes is not None), None),
        server_load=load,
    )
