"""Batched, cache-aware scheduling gives the same greedy tokens as one-at-a-time runs and as
plain `model.generate`, computes each shared prefix once, and keeps the cache consistent."""

from __future__ import annotations

import random

import pytest
import torch

from kvchat.config import CacheConfig, SamplingParams
from kvchat.engine.backend import Backend, Request
from kvchat.engine.scheduler import Scheduler


def backend(model, tokenizer, policy="lru", block=4, blocks=400) -> Backend:
    model.set_attn_implementation("sdpa")
    return Backend.create(model, tokenizer, CacheConfig(block, num_blocks=blocks, policy=policy))


def workload(seed: int = 0) -> list[list[int]]:
    """Shared system prefix (not block-aligned), few-shot variants, exact repeats, and prompts
    that share only part of a block."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(3, 250) for _ in range(n)]  # noqa: E731
    system = words(23)
    shots = system + words(10)
    prompts = [system + words(rng.randrange(3, 9)) for _ in range(5)]
    prompts += [shots + words(4) for _ in range(3)]
    prompts += [prompts[1], prompts[6]]  # exact repeats
    prompts += [words(15), system[:14] + words(6)]  # unrelated; shares 14 (mid-block)
    return prompts


def sequential(b: Backend, prompts, max_new=6):
    params = SamplingParams(max_new_tokens=max_new)
    return [b.generate(Request(p, params)) for p in prompts]


@pytest.mark.parametrize("policy", ["lru", "h2o"])
def test_batched_equals_sequential(tiny_model, tiny_tokenizer, policy):
    prompts = workload()
    seq = sequential(backend(tiny_model, tiny_tokenizer, policy), prompts)
    b = backend(tiny_model, tiny_tokenizer, policy)
    sched = Scheduler(b, batch_size=4)
    tickets = [sched.submit(Request(p, SamplingParams(max_new_tokens=6))) for p in prompts]
    sched.run()
    for t, s in zip(tickets, seq, strict=True):
        assert t.result is not None, t.error
        assert t.result.token_ids == s.token_ids
    assert sched.steps < sum(len(s.token_ids) for s in seq)  # decode steps were shared
    b.cache.check_integrity()
    assert all(blk.ref_count == 0 for blk in b.cache.manager.blocks)


def test_batched_equals_model_generate(tiny_model, tiny_tokenizer):
    prompts = workload(1)
    b = backend(tiny_model, tiny_tokenizer)
    sched = Scheduler(b, batch_size=5)
    tickets = [sched.submit(Request(p, SamplingParams(max_new_tokens=7))) for p in prompts]
    sched.run()
    eos = tiny_tokenizer.eos_token_id
    for t, p in zip(tickets, prompts, strict=True):
        with torch.inference_mode():
            out = tiny_model.generate(
                input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=7, do_sample=False, eos_token_id=eos, pad_token_id=eos,
            )
        assert t.result is not None
        assert t.result.token_ids == out[0, len(p):].tolist()


def test_shared_prefix_is_computed_once(tiny_model, tiny_tokenizer):
    rng = random.Random(5)
    system = [rng.randrange(3, 250) for _ in range(61)]
    prompts = [system + [rng.randrange(3, 250) for _ in range(5)] for _ in range(8)]
    b = backend(tiny_model, tiny_tokenizer)
    sched = Scheduler(b, batch_size=8)
    tickets = [sched.submit(Request(p, SamplingParams(max_new_tokens=3))) for p in prompts]
    sched.run()
    computed = sum(t.result.computed_tokens for t in tickets if t.result)
    distinct = len({tuple(p[:i]) for p in prompts for i in range(1, len(p) + 1)})
    assert distinct <= computed <= distinct * 1.05 + 8
    assert all(t.result.cache_hit_tokens >= 61 for t in tickets[1:] if t.result)


def test_continuous_batching_admits_as_rows_finish(tiny_model, tiny_tokenizer):
    prompts = workload(2)
    b = backend(tiny_model, tiny_tokenizer)
    lengths = [2, 9, 3, 7, 1, 5, 4, 8, 2, 6, 3, 5]
    seq_b = backend(tiny_model, tiny_tokenizer)
    expect = [seq_b.generate(Request(p, SamplingParams(max_new_tokens=n)))
              for p, n in zip(prompts, lengths, strict=True)]
    sched = Scheduler(b, batch_size=3)
    finished = []
    tickets = [sched.submit(Request(p, SamplingParams(max_new_tokens=n)))
               for p, n in zip(prompts, lengths, strict=True)]
    sched.on_finish = finished.append
    sched.run()
    assert [t.result.token_ids for t in tickets] == [e.token_ids for e in expect]
    assert len(finished) == len(prompts)
    b.cache.check_integrity()


def test_cancel_and_abort_keep_the_cache_consistent(tiny_model, tiny_tokenizer):
    b = backend(tiny_model, tiny_tokenizer)
    sched = Scheduler(b, batch_size=4)
    prompts = workload(3)[:6]
    tickets = [sched.submit(Request(p, SamplingParams(max_new_tokens=30, ignore_eos=True)))
               for p in prompts]
    sched.step()
    sched.step()
    tickets[0].cancel()
    sched.step()
    assert tickets[0].result is not None and tickets[0].result.finish_reason == "interrupted"
    sched.abort()
    b.cache.check_integrity()
    assert all(blk.ref_count == 0 for blk in b.cache.manager.blocks)
    started = [t for t in tickets if t.result is not None]
    assert all(t.result.finish_reason == "interrupted" for t in started)
    for t in started:  # what they computed was kept
        assert b.cache.peek(t.request.prompt_ids + t.result.token_ids) >= len(t.request.prompt_ids)


def test_streaming_callbacks_and_errors(tiny_model, tiny_tokenizer):
    b = backend(tiny_model, tiny_tokenizer)
    sched = Scheduler(b, batch_size=2)
    got: dict[int, str] = {}

    def on_text(t, d):
        got[t.request_id] = got.get(t.request_id, "") + d

    good = sched.submit(Request(workload()[0], SamplingParams(max_new_tokens=5)), on_text)
    empty = sched.submit(Request([], SamplingParams(max_new_tokens=5)), on_text)
    sched.run()
    assert empty.error is not None and good.result is not None
    assert got.get(good.request_id, "") == good.result.text


def _cold_kv(model, seq):
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([seq]), use_cache=True)
    return [(layer.keys, layer.values) for layer in out.past_key_values.layers]


def test_interrupt_inside_a_step_keeps_every_row_correct(tiny_model, tiny_tokenizer):
    """A Ctrl-C raised while one row's text is handled must not leave the other rows with
    stale lengths: what abort() stores must be the K/V a cold run computes."""
    b = backend(tiny_model, tiny_tokenizer)
    sched = Scheduler(b, batch_size=4)
    calls = {"n": 0}

    def on_text(t, d):
        calls["n"] += 1
        if t.request_id == 0 and calls["n"] > 12:
            raise KeyboardInterrupt

    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    rng = random.Random(9)
    tickets = [sched.submit(Request([rng.randrange(3, 250) for _ in range(n)], params), on_text)
               for n in (10, 13, 7)]
    with pytest.raises(KeyboardInterrupt):
        sched.run()
    sched.abort()
    b.cache.check_integrity()
    assert all(blk.ref_count == 0 for blk in b.cache.manager.blocks)
    for t in tickets:
        assert t.result is not None
        seq = t.request.prompt_ids + t.result.token_ids
        match = b.cache.tree.find_prefix(seq)
        assert match.matched >= len(t.request.prompt_ids)
        got = b.cache.gather(match.blocks, match.matched)
        ref = _cold_kv(tiny_model, seq[: match.matched])
        assert max(float((k - rk).abs().max()) for (k, _), (rk, _) in zip(got, ref, strict=True)) \
            < 1e-4


def test_failed_admission_releases_what_it_looked_up(tiny_model, tiny_tokenizer, monkeypatch):
    b = backend(tiny_model, tiny_tokenizer)
    finished = []
    sched = Scheduler(b, batch_size=4, on_finish=finished.append)
    rng = random.Random(3)
    system = [rng.randrange(3, 250) for _ in range(9)]
    sched.submit(Request(system + [5, 6, 7], SamplingParams(max_new_tokens=2)))
    sched.run()
    real = b.forward_batch

    def oom(*args, **kwargs):
        if kwargs.get("columns") is not None:  # the wave's batched tail prefill
            raise RuntimeError("out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(b, "forward_batch", oom)
    tickets = [sched.submit(Request(system + [rng.randrange(3, 250) for _ in range(5)],
                                    SamplingParams(max_new_tokens=5))) for _ in range(3)]
    with pytest.raises(RuntimeError, match="out of memory"):
        sched.step()
    assert all(t.done for t in tickets) and len(finished) == 1 + 3
    assert all(blk.ref_count == 0 for blk in b.cache.manager.blocks)
    b.cache.check_integrity()


def test_interrupt_inside_the_final_store_is_reported_once(tiny_model, tiny_tokenizer,
                                                           monkeypatch):
    b = backend(tiny_model, tiny_tokenizer)
    real = b.cache.store
    armed = {"on": True}

    def store(*args, **kwargs):
        if armed["on"] and kwargs.get("logits_len") is not None:  # a request's final store
            armed["on"] = False
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(b.cache, "store", store)
    finished: list[object] = []
    sched = Scheduler(b, batch_size=4, on_finish=finished.append)
    rng = random.Random(4)
    tickets = [sched.submit(Request([rng.randrange(3, 250) for _ in range(6 + i)],
                                    SamplingParams(max_new_tokens=12 - 3 * i, ignore_eos=True)))
               for i in range(3)]
    with pytest.raises(KeyboardInterrupt):
        sched.run()
    sched.abort()
    assert all(t.result is not None for t in tickets)
    assert len(finished) == len({id(t) for t in finished}) == 3  # each reported exactly once
    assert all(blk.ref_count == 0 for blk in b.cache.manager.blocks)
    b.cache.check_integrity()
