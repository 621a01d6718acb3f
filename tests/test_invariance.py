"""The cache changes what an answer costs, never the answer: a property test.

At every precision kvchat runs on CPU, a greedy sequence's tokens and every step's logits are
bitwise those of its lone, cold, one-token-at-a-time run, whatever happens around it: random
batch sizes and prefill chunks, rows joining a running batch, radix and exact hits, replies
drafted from the tree, a head shared by rows with a common header, blocks evicted to the disk
tier and read back. Requests that do not record their logits may end on a replayed reply
(kvchat/engine/replay.py): their tokens must be the lone run's too."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_config, build_tiny_model, make_engine

from kvchat.cache.block_file import BlockLayout
from kvchat.cache.block_store import BlockStore
from kvchat.config import SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.sequence import GenerationResult, Request
from kvchat.models import native
from tests.test_engine import at_precision

pytestmark = pytest.mark.skipif(not native.attention_native(),
                                reason="no native library: the forward is not batch-invariant")
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)


def _prompts(rng: random.Random) -> list[list[int]]:
    """Eight prompts: half start with one 70-token header (a head the batch holds once),
    the rest with a random part of it (radix hits of every length)."""
    header = [rng.randrange(3, 250) for _ in range(70)]
    out = []
    for i in range(8):
        tail = [rng.randrange(3, 250) for _ in range(rng.randrange(1, 30))]
        out.append((header if i % 2 else header[: rng.randrange(5, 70)]) + tail)
    return out


def _drive(engine: Engine, prompts: list[list[int]], rng: random.Random) -> list[GenerationResult]:
    """Submit the first part at once, the rest a few steps apart (rows join a running batch);
    about half do not record their logits, so an exact repeat among them may replay."""
    handles = []
    pending = [Request(p, GREEDY, record_logits=rng.random() < 0.5) for p in prompts]
    cut = rng.randrange(1, len(pending) + 1)
    handles += [engine.submit(r) for r in pending[:cut]]
    pending = pending[cut:]
    while pending or not all(h.done for h in handles):
        if pending and rng.random() < 0.4:
            handles.append(engine.submit(pending.pop(0)))
        engine.step()
    results = [h.result for h in handles]
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def _same(run: GenerationResult, ref: GenerationResult) -> bool:
    if run.step_logits is None:  # it did not record them: its tokens
        return run.token_ids == ref.token_ids
    logits = run.step_logits
    return run.token_ids == ref.token_ids and len(logits) == len(ref.step_logits or []) and all(
        torch.equal(a, b) for a, b in zip(logits, ref.step_logits or [], strict=True))


@pytest.mark.parametrize("precision", ["int4", "int8", "bfloat16", "float32"])
def test_every_row_equals_its_lone_cold_run_bitwise(tiny_tokenizer, tmp_path: Path, precision):
    model = at_precision(build_tiny_model(build_tiny_config(tiny_tokenizer)), precision)
    rng = random.Random(precision)
    prompts = _prompts(rng)
    lone = make_engine(model, tiny_tokenizer, batch_size=1, prefill_chunk=1).without_cache()
    assert lone.runner.invariant
    refs = [lone.generate(Request(p, GREEDY, record_logits=True)) for p in prompts]
    sources, disk_hits, replayed = set(), 0, 0
    for trial in range(3):
        engine = make_engine(model, tiny_tokenizer, batch_size=rng.choice([2, 3, 8]),
                             prefill_chunk=rng.choice([3, 7, 512]),
                             num_blocks=rng.choice([60, 400]))
        store = BlockStore(tmp_path / f"{trial}", BlockLayout.of(engine.cache.manager), 1 << 30,
                           index_every_s=0.05)
        engine.cache.use_store(store, {"model": "tiny"})
        order = list(range(len(prompts))) * 2
        rng.shuffle(order)
        for wave in (order[:8], order[8:]):
            results = _drive(engine, [prompts[i] for i in wave], rng)
            for i, run in zip(wave, results, strict=True):
                sources.add(run.hit_source)
                replayed += run.replayed_tokens > 0
                assert _same(run, refs[i]), (precision, trial, i, run.hit_source,
                                             run.token_ids, refs[i].token_ids)
            engine.cache.evict(engine.cache.manager.num_blocks)  # the next wave reads disk
        engine.cache.check_integrity()
        disk_hits += engine.cache.stats().disk_hits
        store.close()
    assert {"radix", "exact"} <= sources and disk_hits > 0, (sources, disk_hits)
    assert replayed > 0
