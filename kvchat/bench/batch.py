"""kvchat's batch path against what users would otherwise run, on five kinds of request file,
in one run.

Workloads: kvchat.bench.workloads (the same token ids for every runner), greedy, the same
max_new_tokens everywhere. Runners, each timed in-process without the model load:
- kvchat at its defaults: a fresh cache (block size 16), the batch size `kvchat batch` picks
  by default (auto: measured once per run, outside the timed region);
- plain `model.generate`, one request at a time (no reuse): the reference for outputs;
- transformers `generate_batch` (continuous batching, paged, prefix block sharing on), in the
  best configuration found on this machine kind: page_size 16, max_batch_tokens 256;
- with a llama.cpp build (`--llama-cpp`), llama-server on the same GGUF: one request at a time
  on one slot (which reuses the previous prompt's prefix), and 8 at once on 8 slots; a fresh
  server per kind, the same token ids, stopping at EOS as the others do.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kvchat.bench.llama_cpp import LlamaCpp, serve_requests
from kvchat.bench.results import (
    GENERATE,
    LLAMA_SERVER,
    LLAMA_SERVER_8,
    BatchBench,
    BatchSuite,
    Contender,
)
from kvchat.bench.workloads import KINDS, Prompts, build_workload, ideal_hits, ideal_prefill
from kvchat.config import CacheConfig, SamplingParams
from kvchat.engine.autobatch import choose_batch_size
from kvchat.engine.engine import Engine
from kvchat.engine.past import kv_shape
from kvchat.engine.sequence import Request

RUNNERS = ("kvchat", "generate_batch", "generate")  # names for --skip; generate = GENERATE
BLOCK_SIZE = 16
PAGE_SIZE = 16  # generate_batch: its default of 256 was ~3x slower here
MAX_BATCH_TOKENS = 256


def _outputs(rows: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(r) for r in rows)


def run_plain_generate(model: Any, tokenizer: Any, prompts: Prompts, new: int) -> Contender:
    outputs = []
    t = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=new, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
            outputs.append(out[0, len(p):].tolist())
    return Contender(GENERATE, time.perf_counter() - t, _outputs(outputs),
                     sum(len(p) for p in prompts), note="one request at a time")


@contextlib.contextmanager
def _attention(model: Any, name: str) -> Iterator[None]:
    """The model's attention implementation set to `name` for a while, then back."""
    before = str(model.config._attn_implementation)
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def run_generate_batch(
    model: Any, prompts: Prompts, new: int, page_size: int = PAGE_SIZE,
    max_batch_tokens: int = MAX_BATCH_TOKENS,
) -> Contender:
    name = "generate_batch"
    try:
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        gen_cfg = GenerationConfig(max_new_tokens=new, do_sample=False,
                                   eos_token_id=model.generation_config.eos_token_id,
                                   pad_token_id=model.generation_config.eos_token_id)
        cb_cfg = ContinuousBatchingConfig(page_size=page_size, max_batch_tokens=max_batch_tokens,
                                          allow_block_sharing=True)
        # generate_batch refuses inference-mode tensors: run it outside, as its docs do; and it
        # takes only transformers' own attention kernels (kvchat's runner registers its own)
        with torch.no_grad(), _attention(model, "sdpa"):
            t = time.perf_counter()
            res = model.generate_batch(inputs=prompts, generation_config=gen_cfg,
                                       continuous_batching_config=cb_cfg, progress_bar=False)
            seconds = time.perf_counter() - t
    except Exception as exc:  # report, don't crash the other runners
        return Contender(name, None, note=f"could not run: {type(exc).__name__}: {exc}")
    outs = sorted(res.values(), key=lambda o: _request_index(o.request_id))
    return Contender(name, seconds, _outputs([o.generated_tokens for o in outs]),
                     note=f"page_size={page_size}, max_batch_tokens={max_batch_tokens}, "
                     "allow_block_sharing=True")


def run_llama_server(llama: LlamaCpp, gguf: Path, prompts: Prompts, new: int,
                     parallel: int) -> Contender:
    """The workload through a fresh llama-server with `parallel` slots, as many at once."""
    with llama.server(gguf, parallel) as url:
        serve_requests(url, [unrelated_prompt(prompts)], 2, 1)  # warm-up: not timed
        done = serve_requests(url, prompts, new, parallel, ignore_eos=False)
    return Contender(LLAMA_SERVER if parallel == 1 else LLAMA_SERVER_8, done.wall_s, (),
                     done.prompt - done.cached, done.cached,
                     f"{parallel} slot{'s' if parallel > 1 else ''}, {parallel} at once, "
                     "2 threads, cache_prompt")


def unrelated_prompt(prompts: Prompts, length: int = 8) -> list[int]:
    """A short prompt whose first token starts no prompt of the workload: a peer warmed up on
    it starts the timed run with nothing of the workload cached, as kvchat's fresh cache does
    (llama-server keeps its last prompt in the slot, and earlier ones in host memory)."""
    firsts = {p[0] for p in prompts if p}
    token = next(t for t in range(1, len(firsts) + 2) if t not in firsts)
    return [token] * length


def _request_index(request_id: str) -> int:
    digits = "".join(ch for ch in request_id if ch.isdigit())
    return int(digits) if digits else 0


def default_pool_tokens(model: Any, block_size: int) -> int:
    """Tokens the default --cache-mb holds on this model: the pool `kvchat batch` bounds its
    automatic batch size by (the bench's own pool is sized to the workload instead)."""
    n_layers, kv_heads, head_dim = kv_shape(model.config)
    per_token = 2 * n_layers * kv_heads * head_dim * next(model.parameters()).element_size()
    return CacheConfig(block_size).blocks_for(per_token) * block_size


def run_kvchat(
    model: Any, tokenizer: Any, prompts: Prompts, new: int, batch_size: int | None = None,
    block_size: int = BLOCK_SIZE, remember: Path | None = None,
) -> Contender:
    """A fresh engine at its defaults, the pool sized to hold the whole workload so nothing is
    evicted. batch_size None: chosen as `kvchat batch` does by default (auto: decode steps
    measured once, kept in `remember`, bounded by the default pool), before the clock starts."""
    longest = max(len(p) for p in prompts) + new
    blocks = (len(prompts) + 2) * (longest + block_size) // block_size
    engine = Engine.create(model, tokenizer, CacheConfig(block_size, num_blocks=blocks))
    if batch_size is None:
        choice = choose_batch_size(engine.runner, "kvchat bench batch", remember,
                                   default_pool_tokens(model, block_size), longest)
        bounded = ", bounded by the default pool" if choice.bound < choice.best else ""
        engine.batch_size, how = choice.size, f"{choice.size} (auto{bounded})"
    else:
        engine.batch_size, how = batch_size, f"{batch_size} (--batch-size)"
    params = SamplingParams(max_new_tokens=new)
    t = time.perf_counter()
    tickets = [engine.submit(Request(p, params)) for p in prompts]
    while not engine.idle:
        engine.step()
    seconds = time.perf_counter() - t
    results = [t.result for t in tickets]
    outputs = _outputs([r.token_ids if r else [] for r in results])
    computed = sum(r.computed_tokens for r in results if r)
    hits = sum(r.cache_hit_tokens for r in results if r)
    return Contender("kvchat", seconds, outputs, computed, hits,
                     f"batch_size={how}, block_size={block_size}, fresh cache"
                     + _drafts_note([r for r in results if r is not None]))


def _drafts_note(results: Sequence[Any]) -> str:
    """What the cache did for replies: exact repeats that ended on a stored greedy reply (no
    forward), reply tokens drafted, and the drafting repeats' decode forwards against the tokens
    they decoded (the first token of each is the stored logits')."""
    replayed = [r for r in results if r.replayed_tokens]
    note = ""
    if replayed:
        tokens = sum(r.replayed_tokens for r in replayed)
        note += f"; {len(replayed):,} exact repeats replayed {tokens:,} reply tokens, no forward"
    drafted = sum(r.draft_accepted for r in results)
    if not drafted:
        return note
    repeats = [r for r in results if r.hit_source == "exact" and r.draft_accepted]
    tokens = sum(len(r.token_ids) - 1 for r in repeats)
    forwards = sum(r.decode_forwards for r in repeats)
    note += f"; {drafted:,} reply tokens drafted from the cache"
    if forwards:
        note += (f", exact repeats decoded {tokens:,} tokens in {forwards:,} forwards "
                 f"({tokens / forwards:.1f} per forward)")
    return note


def warm_up(model: Any, tokenizer: Any) -> None:
    """One tiny untimed generate, so the first timed runner does not pay torch's first-call
    costs."""
    ids = torch.tensor([[tokenizer.eos_token_id or 0] * 8], device=model.device)
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                       do_sample=False, pad_token_id=tokenizer.eos_token_id)


def bench_kind(
    model: Any, tokenizer: Any, kind: str, prompts: Prompts, new_tokens: int,
    batch_size: int | None, include: Sequence[str],
    progress: Callable[[str], None] | None = None, remember: Path | None = None,
    llama: tuple[LlamaCpp, Path] | None = None,
) -> BatchBench:
    """One workload through every included runner (remember: see run_kvchat; llama: a
    llama.cpp build and the GGUF it runs)."""
    steps: list[tuple[str, str, Callable[[], Contender]]] = [
        ("kvchat", "kvchat", lambda: run_kvchat(model, tokenizer, prompts, new_tokens,
                                                 batch_size, remember=remember)),
        ("generate_batch", "transformers generate_batch",
         lambda: run_generate_batch(model, prompts, new_tokens)),
        ("generate", "plain model.generate, one by one",
         lambda: run_plain_generate(model, tokenizer, prompts, new_tokens)),
    ]
    if llama is not None:
        build, gguf = llama
        steps += [(LLAMA_SERVER, "llama-server, one at a time",
                   lambda: run_llama_server(build, gguf, prompts, new_tokens, 1)),
                  (LLAMA_SERVER_8, "llama-server, 8 at once",
                   lambda: run_llama_server(build, gguf, prompts, new_tokens, 8))]
        include = (*include, LLAMA_SERVER, LLAMA_SERVER_8)
    contenders = []
    for name, label, run in steps:
        if name in include:
            if progress:
                progress(f"{kind}: {label}")
            contenders.append(run())
    return BatchBench(kind, len(prompts), sum(len(p) for p in prompts), new_tokens,
                      ideal_prefill(prompts), ideal_hits(prompts), tuple(contenders))


def bench_batch(
    model: Any,
    tokenizer: Any,
    kinds: Sequence[str] = ("shared-system",),
    new_tokens: int = 16,
    batch_size: int | None = None,
    include: Sequence[str] = RUNNERS,
    requests: int = 32,
    system_tokens: int = 600,
    progress: Callable[[str], None] | None = None,
    llama: tuple[LlamaCpp, Path] | None = None,
) -> BatchSuite:
    """Every kind in `kinds` (see workloads.KINDS) through every runner in `include`;
    `requests` and `system_tokens` size the shared-system workload."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown workload kind(s): {', '.join(unknown)}")
    warm_up(model, tokenizer)
    # kvchat's automatic batch size is measured once per run, as `kvchat batch` does per model
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-") as tmp:
        return BatchSuite(new_tokens, torch_threads=torch.get_num_threads(), kinds=tuple(
            bench_kind(model, tokenizer, kind,
                       build_workload(kind, tokenizer, requests, system_tokens),
                       new_tokens, batch_size, include, progress,
                       Path(tmp) / "batch-size.json", llama)
            for kind in kinds
        ))
