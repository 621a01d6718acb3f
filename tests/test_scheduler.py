"""Batched, cache-aware scheduling gives the same greedy tokens as one-at-a-time runs and as
plain `model.generate`, computes each shared prefix once, and keeps the cache consistent."""

from __future__ import annotations

import contextlib
import json
import random

import pytest
import torch
from conftest import make_engine

from kvchat.config import SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.scheduler import common_prefix
from kvchat.engine.sequence import Finished, Request, TextDelta


def backend(model, tokenizer, policy="lru", block=4, blocks=400, batch_size=8) -> Engine:
    return make_engine(model, tokenizer, block_size=block, num_blocks=blocks, policy=policy,
                       batch_size=batch_size)


def drain(engine: Engine) -> None:
    while not engine.idle:
        engine.step()


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


def sequential(b: Engine, prompts, max_new=6):
    params = SamplingParams(max_new_tokens=max_new)
    return [b.generate(Request(p, params)) for p in prompts]


@pytest.mark.parametrize("policy", ["lru", "h2o"])
def test_batched_equals_sequential(tiny_model, tiny_tokenizer, policy):
    prompts = workload()
    seq = sequential(backend(tiny_model, tiny_tokenizer, policy), prompts)
    b = backend(tiny_model, tiny_tokenizer, policy, batch_size=4)
    tickets = [b.submit(Request(p, SamplingParams(max_new_tokens=6))) for p in prompts]
    drain(b)
    for t, s in zip(tickets, seq, strict=True):
        assert t.result is not None, t.error
        assert t.result.token_ids == s.token_ids
    assert b.steps < sum(len(s.token_ids) for s in seq)  # decode steps were shared
    b.cache.check_integrity()
    assert all(blk.ref_count == 0 for blk in b.cache.manager.blocks)


def test_batched_equals_model_generate(tiny_model, tiny_tokenizer):
    prompts = workload(1)
    b = backend(tiny_model, tiny_tokenizer, batch_size=5)
    tickets = [b.submit(Request(p, SamplingParams(max_new_tokens=7))) for p in prompts]
    drain(b)
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
    b = backend(tiny_model, tiny_tokenizer, batch_size=8)
    tickets = [b.submit(Request(p, SamplingParams(max_new_tokens=3))) for p in prompts]
    drain(b)
    computed = sum(t.result.computed_tokens for t in tickets if t.result)
    distinct = len({tuple(p[:i]) for p in prompts for i in range(1, len(p) + 1)})
    assert distinct <= computed <= distinct * 1.05 + 8
    assert all(t.result.cache_hit_tokens >= 61 for t in tickets[1:] if t.result)


def test_continuous_batching_admits_as_rows_finish(tiny_model, tiny_tokenizer):
    prompts = workload(2)
    b = backend(tiny_model, tiny_tokenizer, batch_size=3)
    lengths = [2, 9, 3, 7, 1, 5, 4, 8, 2, 6, 3, 5]
    seq_b = backend(tiny_model, tiny_tokenizer)
    expect = [seq_b.generate(Request(p, SamplingParams(max_new_tokens=n)))
              for p, n in zip(prompts, lengths, strict=True)]
    finished: list[Finished] = []

    def on_event(event):
        if isinstance(event, Finished):
            finished.append(event)

    tickets = [b.submit(Request(p, SamplingParams(max_new_tokens=n)), on_event)
               for p, n in zip(prompts, lengths, strict=True)]
    drain(b)
    assert [t.result.token_ids for t in tickets] == [e.token_ids for e in expect]
    assert len(finished) == len(prompts)
    b.cache.check_integrity()


def test_cancel_and_abort_keep_the_cache_consistent(tiny_model, tiny_tokenizer):
    b = backend(tiny_model, tiny_tokenizer, batch_size=4)
    prompts = workload(3)[:6]
    tickets = [b.submit(Request(p, SamplingParams(max_new_tokens=30, ignore_eos=True)))
               for p in prompts]
    b.step()
    b.step()
    tickets[0].cancel()
    b.step()
    assert tickets[0].result is not None and tickets[0].result.finish_reason == "interrupted"
    b.abort()
    assert all(t.done for t in tickets)
    assert all(t.result is None for t in tickets[4:]), "never started: no result, an error"
    b.cache.check_integrity()
    assert all(blk.ref_count == 0 for blk in b.cache.manager.blocks)
    started = [t for t in tickets if t.result is not None]
    assert all(t.result.finish_reason == "interrupted" for t in started)
    for t in started:  # what they computed was kept
        prompt_ids = t.seq.prompt_ids
        assert b.cache.peek(prompt_ids + t.result.token_ids) >= len(prompt_ids)


def _cold_kv(model, seq):
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([seq]), use_cache=True)
    return [(layer.keys, layer.values) for layer in out.past_key_values.layers]


def test_interrupt_inside_a_step_keeps_every_row_correct(tiny_model, tiny_tokenizer):
    """A Ctrl-C raised while one row's text is handled must not leave the other rows with
    stale lengths: what abort() stores must be the K/V a cold run computes."""
    b = backend(tiny_model, tiny_tokenizer, batch_size=4)
    calls = {"n": 0}

    def listener(row: int):
        def on_event(event):
            if isinstance(event, TextDelta):
                calls["n"] += 1
                if row == 0 and calls["n"] > 12:
                    raise KeyboardInterrupt
        return on_event

    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    rng = random.Random(9)
    tickets = [b.submit(Request([rng.randrange(3, 250) for _ in range(n)], params), listener(i))
               for i, n in enumerate((10, 13, 7))]
    with pytest.raises(KeyboardInterrupt):
        drain(b)
    b.cache.check_integrity()
    assert all(blk.ref_count == 0 for blk in b.cache.manager.blocks)
    for t in tickets:
        assert t.result is not None
        seq = t.seq.prompt_ids + t.result.token_ids
        match = b.cache.tree.find_prefix(seq)
        assert match.matched >= len(t.seq.prompt_ids)
        got = b.cache.gather(match.blocks, match.matched)
        ref = _cold_kv(tiny_model, seq[: match.matched])
        assert max(float((k - rk).abs().max()) for (k, _), (rk, _) in zip(got, ref, strict=True)) \
            < 1e-4


def test_failed_admission_fails_only_its_requests(tiny_model, tiny_tokenizer, monkeypatch):
    b = backend(tiny_model, tiny_tokenizer, batch_size=4)
    rng = random.Random(3)
    system = [rng.randrange(3, 250) for _ in range(9)]
    running = b.submit(Request(system + [5, 6, 7], SamplingParams(max_new_tokens=8)))
    b.step()  # admitted and decoding
    real = b.runner.forward

    def oom(*args, **kwargs):
        if kwargs.get("columns") is not None:  # the wave's batched tail prefill
            raise RuntimeError("out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(b.runner, "forward", oom)
    tickets = [b.submit(Request(system + [rng.randrange(3, 250) for _ in range(5)],
                                SamplingParams(max_new_tokens=5))) for _ in range(3)]
    drain(b)
    assert all(isinstance(t.error, RuntimeError) for t in tickets)
    assert running.error is None and running.result is not None
    assert running.result.finish_reason in ("stop", "length")
    assert all(blk.ref_count == 0 for blk in b.cache.manager.blocks)
    b.cache.check_integrity()


def test_interrupt_inside_the_final_store_is_reported_once(tiny_model, tiny_tokenizer,
                                                           monkeypatch):
    b = backend(tiny_model, tiny_tokenizer, batch_size=4)
    real = b.cache.write_kv
    armed = {"on": True}

    def write_kv(tokens, *args, **kwargs):
        if armed["on"] and len(tokens) > kwargs["logits_len"]:  # a request's final store
            armed["on"] = False
            raise KeyboardInterrupt
        return real(tokens, *args, **kwargs)

    monkeypatch.setattr(b.cache, "write_kv", write_kv)
    finished: list[object] = []

    def on_event(event):
        if isinstance(event, Finished):
            finished.append(event)

    rng = random.Random(4)
    tickets = [b.submit(Request([rng.randrange(3, 250) for _ in range(6 + i)],
                                SamplingParams(max_new_tokens=12 - 3 * i, ignore_eos=True)),
                        on_event)
               for i in range(3)]
    with pytest.raises(KeyboardInterrupt):
        drain(b)
    b.abort()
    assert all(t.result is not None for t in tickets)
    assert len(finished) == len({id(t) for t in finished}) == 3  # each reported exactly once
    assert all(blk.ref_count == 0 for blk in b.cache.manager.blocks)
    b.cache.check_integrity()


# ---- token-exact admission: reuse against the ideal ----------------------------------------


class _FixedCosts:
    """This CPU's figures for the embedded model (a decode step ~58 ms, prefill ~2 ms per
    token): one decode step buys 29 prompt tokens. Fixed, so the test does not depend on
    timing."""

    decode_s, prefill_token_s = 0.058, 0.002
    wait_tokens = 29.0

    def decode(self, seconds: float) -> None:
        pass

    def prefill(self, tokens: int, seconds: float) -> None:
        pass


def _kinds(seed: int = 7) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(3, 250) for _ in range(n)]  # noqa: E731
    system, header = words(70), words(45)
    convs = [words(20) for _ in range(3)]
    turns = []
    for _ in range(3):  # interleaved: each turn extends that conversation's previous prompt
        for c in range(3):
            convs[c] = convs[c] + words(6) + words(5)
            turns.append(list(convs[c]))
    distinct = [words(rng.randrange(8, 14)) for _ in range(4)]
    repeats = distinct * 3
    rng.shuffle(repeats)
    g47, g113 = words(47), words(113)
    return {
        "shared-system": [system + words(rng.randrange(4, 9)) for _ in range(12)],
        "few-shot": [header + words(6) for _ in range(10)],
        "multi-turn": turns,
        "repeats": repeats,
        "unaligned": [g47 + words(9) for _ in range(5)] + [g113 + words(7) for _ in range(5)],
    }


def ideal_reuse(prompts: list[list[int]]) -> int:
    """Per line, the longest prefix it shares with any earlier line (a whole exact repeat;
    otherwise at most all but the last token, which a non-exact hit always computes)."""
    total = 0
    for i, p in enumerate(prompts):
        earlier = prompts[:i]
        if p in earlier:
            total += len(p)
            continue
        best = max((common_prefix(p, q) for q in earlier), default=0)
        total += min(best, len(p) - 1)
    return total


@pytest.mark.parametrize("block", [16, 64])
@pytest.mark.parametrize("batch_size", [8, 32])
@pytest.mark.parametrize("kind", ["shared-system", "few-shot", "multi-turn", "repeats",
                                  "unaligned"])
def test_reuse_is_the_ideal_whatever_the_block_and_batch_size(tiny_model, tiny_tokenizer, kind,
                                                              block, batch_size):
    prompts = _kinds()[kind]
    b = backend(tiny_model, tiny_tokenizer, block=block, blocks=4000 // block,
                batch_size=batch_size)
    b.scheduler.costs = _FixedCosts()
    handles = [b.submit(Request(p, SamplingParams(max_new_tokens=2))) for p in prompts]
    drain(b)
    hits = sum(h.result.cache_hit_tokens for h in handles if h.result)
    ideal = ideal_reuse(prompts)
    assert ideal > 0 and hits >= 0.99 * ideal, (hits, ideal)
    assert sum(h.result.hit_source == "exact" for h in handles if h.result) == \
        len(prompts) - len({tuple(p) for p in prompts})  # every repeat answered from logits
    b.cache.check_integrity()


def test_a_short_shared_prefix_is_not_worth_a_step(tiny_model, tiny_tokenizer):
    """Below the break-even, wave-mates are admitted together and each computes the few shared
    tokens: an idle row's share of a decode step (29 tokens / 4 rows) costs more than 6."""
    rng = random.Random(11)
    head = [rng.randrange(3, 250) for _ in range(6)]
    prompts = [head + [rng.randrange(3, 250) for _ in range(12)] for _ in range(4)]
    b = backend(tiny_model, tiny_tokenizer, batch_size=8)
    b.scheduler.costs = _FixedCosts()
    handles = [b.submit(Request(p, SamplingParams(max_new_tokens=2))) for p in prompts]
    b.step()  # one wave took all four
    assert all(h.seq.status.value != "waiting" for h in handles)
    drain(b)
    assert all(h.result.cache_hit_tokens == 0 for h in handles)


def test_step_costs_learn_the_break_even():
    from kvchat.engine.scheduler import StepCosts

    costs = StepCosts()
    assert costs.wait_tokens == 0.0  # nothing measured: wait for any shared prefix
    costs.decode(0.06)
    costs.prefill(100, 0.2)
    assert costs.wait_tokens == pytest.approx(30.0)
    for _ in range(30):
        costs.decode(0.01)
    assert costs.wait_tokens == pytest.approx(5.0, rel=0.05)


# ---- --batch-size auto --------------------------------------------------------------------


def test_auto_batch_size_is_the_smallest_near_the_best_throughput():
    from kvchat.engine.autobatch import best_size

    # weight-bound up to 16 rows (a step costs the same), then compute-bound
    flat_then_linear = {1: 0.05, 2: 0.05, 4: 0.05, 8: 0.052, 16: 0.055, 32: 0.105, 64: 0.21}
    assert best_size(flat_then_linear) == 16
    assert best_size({1: 0.01, 2: 0.02, 4: 0.04}) == 1  # no gain from batching at all
    assert best_size({1: 0.05, 2: 0.05, 4: 0.05, 8: 0.05}) == 8
    # one slow measurement at 2 rows (a busy machine) does not stop the search
    assert best_size({1: 0.04, 2: 0.2, 4: 0.06, 8: 0.06, 16: 0.07, 32: 0.1, 64: 0.17}) == 64


CLEAN = {1: 0.010, 2: 0.010, 4: 0.011, 8: 0.012, 16: 0.014, 32: 0.020, 64: 0.035}
BUSY = {**CLEAN, 2: 0.050}  # 2 rows measured slower than 64: the machine was busy


def test_auto_batch_size_is_measured_once_and_bounded_by_the_pool(tiny_model, tiny_tokenizer,
                                                                  tmp_path, monkeypatch):
    from kvchat.engine import autobatch
    from kvchat.engine.autobatch import choose_batch_size

    b = backend(tiny_model, tiny_tokenizer)
    real = autobatch.measure_steps(b.runner, sizes=(1, 8), repeats=1)
    assert set(real) == {1, 8} and all(t > 0 for t in real.values())
    monkeypatch.setattr(autobatch, "measure_steps", lambda runner, sizes=(): dict(CLEAN))
    remember = tmp_path / "batch-size.json"
    shown: list[str] = []

    def status(message: str):
        shown.append(message)
        return contextlib.nullcontext()

    first = choose_batch_size(b.runner, "tiny|cpu", remember, pool_tokens=10**6, seq_tokens=100,
                              status=status)
    assert not first.reused and remember.exists() and set(first.measured) >= {1, 8, 32}
    assert shown == [autobatch.measuring(autobatch.SIZES)]  # the spinner, while it measured
    again = choose_batch_size(b.runner, "tiny|cpu", remember, pool_tokens=10**6, seq_tokens=100)
    assert again.reused and again.measured == first.measured and again.size == first.size
    tight = choose_batch_size(b.runner, "tiny|cpu", remember, pool_tokens=300, seq_tokens=100)
    assert tight.bound == 3 and tight.size == min(first.best, 3)
    assert "auto" in tight.describe()
    assert len(shown) == 1  # nothing measured again, nothing shown


def test_a_noisy_measurement_is_repeated_kept_and_refined_only_by_a_long_run(
        tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    from kvchat.engine import autobatch

    assert autobatch.noisy(BUSY) and not autobatch.noisy(CLEAN)
    b = backend(tiny_model, tiny_tokenizer)
    remember = tmp_path / "batch-size.json"
    sweeps = [dict(BUSY), dict(CLEAN)]
    monkeypatch.setattr(autobatch, "measure_steps", lambda runner, sizes=(): sweeps.pop(0))
    settled = autobatch.choose_batch_size(b.runner, "k", remember, 10**6, 100)
    assert not sweeps and settled.measured == CLEAN and not settled.noisy  # measured again
    kept = json.loads(remember.read_text())["k"]
    assert kept["steps"]["2"] == CLEAN[2] and kept["noisy"] is False
    # a machine busy through every sweep: kept and marked noisy
    calls: list[tuple[int, ...]] = []

    def busy_steps(runner, sizes=()):
        calls.append(tuple(sizes))
        return {s: BUSY[s] for s in sizes}

    monkeypatch.setattr(autobatch, "measure_steps", busy_steps)
    busy = autobatch.choose_batch_size(b.runner, "busy", remember, 10**6, 100)
    assert busy.noisy and "noisy: kept, measured again by a long run" in busy.describe()
    assert json.loads(remember.read_text())["busy"]["noisy"] is True
    assert len(calls) == autobatch.ROUNDS  # each sweep was noisy: measured ROUNDS times
    # a short run reuses the noisy sweep: measuring it again would cost more than the run
    calls.clear()
    short = autobatch.choose_batch_size(b.runner, "busy", remember, 10**6, 100, rows=4,
                                        work_steps=64)
    assert short.reused and short.noisy and calls == []
    # a long run pays for measuring it again, and a clean sweep replaces the mark
    monkeypatch.setattr(autobatch, "measure_steps",
                        lambda runner, sizes=(): {s: CLEAN[s] for s in sizes})
    cost = autobatch.measure_cost(autobatch.SIZES)
    long = autobatch.choose_batch_size(b.runner, "busy", remember, 10**6, 100,
                                       work_steps=autobatch.REFINE * cost)
    assert not long.reused and not long.noisy and long.measured == CLEAN
    assert json.loads(remember.read_text())["busy"]["noisy"] is False
    # a noisy measurement an older kvchat kept in the flat format is measured again
    remember.write_text(json.dumps({"old": {str(k): v for k, v in BUSY.items()}}))
    again = autobatch.choose_batch_size(b.runner, "old", remember, 10**6, 100)
    assert not again.reused and json.loads(remember.read_text())["old"]["steps"]["2"] == CLEAN[2]
    # a clean flat entry from an older kvchat is reused as it is
    remember.write_text(json.dumps({"flat": {str(k): v for k, v in CLEAN.items()}}))
    flat = autobatch.choose_batch_size(b.runner, "flat", remember, 10**6, 100)
    assert flat.reused and flat.measured == CLEAN


def test_a_small_file_measures_only_the_sizes_it_can_use_and_its_second_run_nothing(
        tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    from kvchat.engine import autobatch

    b = backend(tiny_model, tiny_tokenizer)
    remember = tmp_path / "batch-size.json"
    calls: list[tuple[int, ...]] = []

    def steps(runner, sizes=()):
        calls.append(tuple(sizes))
        return {s: CLEAN[s] for s in sizes}

    monkeypatch.setattr(autobatch, "measure_steps", steps)
    shown: list[str] = []

    def status(message: str):
        shown.append(message)
        return contextlib.nullcontext()

    assert autobatch.usable_sizes(3) == (1, 2, 4)
    assert autobatch.usable_sizes(None) == autobatch.SIZES
    assert autobatch.usable_sizes(500) == autobatch.SIZES
    first = autobatch.choose_batch_size(b.runner, "k", remember, 10**6, 100, status=status,
                                        rows=3, work_steps=30)
    assert calls == [(1, 2, 4)] and set(first.measured) == {1, 2, 4} and first.size <= 4
    assert shown == [autobatch.measuring((1, 2, 4))] and "1 to 4 rows" in shown[0]
    second = autobatch.choose_batch_size(b.runner, "k", remember, 10**6, 100, status=status,
                                         rows=3, work_steps=30)
    assert second.reused and calls == [(1, 2, 4)] and len(shown) == 1
    assert second.size == first.size and "measured earlier" in second.describe()
    # a larger file measures only the sizes nobody measured yet
    bigger = autobatch.choose_batch_size(b.runner, "k", remember, 10**6, 100, rows=20,
                                         work_steps=200)
    assert calls[-1] == (8, 16, 32) and set(bigger.measured) == {1, 2, 4, 8, 16, 32}
    assert json.loads(remember.read_text())["k"]["noisy"] is False


def test_prefill_groups_tails_of_similar_length():
    """Short tails share a padded forward only with tails of similar length: one long tail
    among short ones would pad every row to its length."""
    from types import SimpleNamespace

    from kvchat.engine.scheduler import Scheduler

    def seq(prompt: int, matched: int):
        return SimpleNamespace(prompt_ids=[0] * prompt, matched=matched, exact=False)

    short = [seq(64, 47) for _ in range(7)]  # 17-token tails
    long = seq(130, 0)
    plan = Scheduler(8, 512).prefill_plan([*short, long], track_mass=False)
    assert plan.alone == [long] and plan.together == [short]
    pair = [seq(130, 0), seq(131, 0)]
    plan = Scheduler(8, 512).prefill_plan([*short, *pair], track_mass=False)
    assert plan.alone == [] and plan.together == [short, pair]
    plan = Scheduler(8, 512).prefill_plan([seq(30, 0), seq(700, 0)], track_mass=False)
    assert len(plan.alone) == 2 and plan.together == []


def shared_prefills(engine: Engine, monkeypatch) -> list[tuple[int, int]]:
    """(tails, shared past length) of each `prefill_shared` call the engine makes from now."""
    calls: list[tuple[int, int]] = []
    shared = engine.runner.prefill_shared

    def counted(tails, past, p_len):
        calls.append((len(tails), p_len))
        return shared(tails, past, p_len)

    monkeypatch.setattr(engine.runner, "prefill_shared", counted)
    return calls


def test_tails_after_one_cached_past_share_one_row(tiny_model, tiny_tokenizer, monkeypatch):
    """Prompts whose cached past is the same blocks prefill their tails side by side in one
    row after it; each equals its cold run (float32: same tokens, logits within 1e-4)."""
    from tests.test_engine import prompt

    engine = backend(tiny_model, tiny_tokenizer)
    header = prompt(400, 27)  # not block-aligned: the shared past ends inside a block
    engine.generate(Request(header + prompt(401, 5), SamplingParams(max_new_tokens=1)))
    calls = shared_prefills(engine, monkeypatch)
    prompts = [header + prompt(410 + i, 3 + i) for i in range(4)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    handles = [engine.submit(Request(p, params, record_logits=True)) for p in prompts]
    drain(engine)
    assert calls == [(4, 27)]
    for p, h in zip(prompts, handles, strict=True):
        cold = engine.without_cache().generate(Request(p, params, record_logits=True))
        assert h.result.token_ids == cold.token_ids and h.result.cache_hit_tokens == 27
        diff = (torch.stack(h.result.step_logits) - torch.stack(cold.step_logits)).abs().max()
        assert float(diff) <= 1e-4
    engine.cache.check_integrity()


def test_tails_share_one_row_after_what_all_prompts_share(tiny_model, tiny_tokenizer,
                                                         monkeypatch):
    """Prompts cached further than they agree (each through its own earlier sibling) still
    prefill after one past: the tokens they all share, here ending before any one's match."""
    from tests.test_engine import prompt

    engine = backend(tiny_model, tiny_tokenizer)
    header = prompt(400, 27)
    one = header + prompt(401, 6)
    two = header[:-1] + prompt(402, 7)  # parts from the header one token early
    for p in (one, two):
        engine.generate(Request(p, SamplingParams(max_new_tokens=1)))
    calls = shared_prefills(engine, monkeypatch)
    prompts = [one[:30] + prompt(410, 4), two[:29] + prompt(411, 5)]
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    handles = [engine.submit(Request(p, params, record_logits=True)) for p in prompts]
    drain(engine)
    assert [h.result.cache_hit_tokens for h in handles] == [30, 29]
    assert calls == [(2, 26)]
    for p, h in zip(prompts, handles, strict=True):
        cold = engine.without_cache().generate(Request(p, params, record_logits=True))
        assert h.result.token_ids == cold.token_ids
        diff = (torch.stack(h.result.step_logits) - torch.stack(cold.step_logits)).abs().max()
        assert float(diff) <= 1e-4
    engine.cache.check_integrity()


def test_long_cached_histories_after_a_short_shared_header_keep_their_hits(
        tiny_model, tiny_tokenizer, monkeypatch):
    """Conversations that share only a system prompt each prefill after their own cached
    history: sharing the header's past would compute their histories again."""
    from tests.test_engine import prompt

    engine = backend(tiny_model, tiny_tokenizer)
    system = prompt(420, 10)
    histories = [system + prompt(421 + i, 40) for i in range(3)]
    for h in histories:
        engine.generate(Request(h, SamplingParams(max_new_tokens=1)))
    calls = shared_prefills(engine, monkeypatch)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    handles = [engine.submit(Request(h + prompt(430 + i, 4), params))
               for i, h in enumerate(histories)]
    drain(engine)
    assert calls == []
    assert [h.result.cache_hit_tokens for h in handles] == [50, 50, 50]
    engine.cache.check_integrity()
