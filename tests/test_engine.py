"""Cached generation equals cold generation, for every precision, every policy and every way a
request can hit the cache (float32: tokens identical, logits within 1e-4; bfloat16 compute:
within `verify.tolerance`, a divergence only at a tie); H2O really ranks by attention mass."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_engine

from kvchat.config import POLICY_NAMES, CacheConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.sequence import Finished, Request, TextDelta
from kvchat.engine.verify import compare, verify_prompt
from kvchat.errors import KvchatError
from kvchat.models.precision import QUANTIZED
from kvchat.models.quant import quantize_model

ATOL = 1e-4
BLOCK = 4


def make_backend(model, tokenizer, policy: str, num_blocks: int = 256, chunk: int = 512,
                 batch_size: int = 8) -> Engine:
    return make_engine(model, tokenizer, block_size=BLOCK, num_blocks=num_blocks, policy=policy,
                       batch_size=batch_size, prefill_chunk=chunk)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 250) for _ in range(n)]


def run(backend: Engine, ids: list[int], max_new: int = 8):
    return backend.generate(
        Request(ids, SamplingParams(max_new_tokens=max_new), record_logits=True)
    )


def assert_same(cold, warm, precision: str = "float32") -> None:
    c = compare(cold, warm, precision)
    if precision == "float32":
        assert c.equal, f"tokens diverge at {c.first}: {cold.token_ids} vs {warm.token_ids}"
        assert c.diff <= ATOL, f"max |logit diff| {c.diff}"
    else:
        assert c.ok, f"{precision}: {c} ({cold.token_ids} vs {warm.token_ids})"


def at_precision(model, precision: str):
    """The tiny model with its linear layers packed (int8 / int4) or cast (a float dtype)."""
    if precision in QUANTIZED:
        quantize_model(model, precision)
    else:
        model.to(getattr(torch, precision))
    return model


@pytest.fixture(params=POLICY_NAMES)
def policy(request) -> str:
    return request.param


@pytest.fixture(params=("float32", "bfloat16", *QUANTIZED))
def precise_model(request, tiny_model):
    return at_precision(tiny_model, request.param)


def test_full_hit(precise_model, tiny_tokenizer, policy):
    b = make_backend(precise_model, tiny_tokenizer, policy)
    ids = prompt(1, 37)
    run(b, ids + prompt(2, 9))  # caches ids as the prefix of a longer sequence
    cold = run(b.without_cache(), ids)
    warm = run(b, ids)
    assert warm.hit_source == "radix" and warm.cache_hit_tokens == len(ids) - 1
    assert warm.computed_tokens == 1
    assert_same(cold, warm, b.runner.precision)
    b.cache.check_integrity()


def test_exact_repeat_needs_no_forward(precise_model, tiny_tokenizer, policy):
    b = make_backend(precise_model, tiny_tokenizer, policy)
    ids = prompt(3, 29)
    cold = run(b.without_cache(), ids)
    first = run(b, ids)
    assert first.hit_source == "miss"
    calls = b.runner.forward_calls
    one = b.generate(Request(ids, SamplingParams(max_new_tokens=1), record_logits=True))
    assert b.runner.forward_calls == calls, "an exact repeat samples its first token from " \
        "stored logits"
    assert one.hit_source == "exact" and one.cache_hit_tokens == len(ids)
    assert one.token_ids == cold.token_ids[:1]
    warm = run(b, ids)
    assert warm.hit_source == "exact"
    assert_same(cold, warm, b.runner.precision)
    b.cache.check_integrity()


def test_partial_and_unaligned_hits(precise_model, tiny_tokenizer, policy):
    b = make_backend(precise_model, tiny_tokenizer, policy)
    shared = prompt(4, 24)  # block-aligned shared prefix
    run(b, shared + prompt(5, 10))
    ids = shared + prompt(6, 11)
    warm = run(b, ids)
    assert warm.cache_hit_tokens == 24
    assert_same(run(b.without_cache(), ids), warm, b.runner.precision)
    odd = prompt(7, 47)  # 47 shared tokens: ends mid-block
    run(b, odd + [1, 2, 3, 4, 5])
    ids = odd + [9, 8, 7]
    warm = run(b, ids)
    assert warm.cache_hit_tokens == 47
    assert_same(run(b.without_cache(), ids), warm, b.runner.precision)
    b.cache.check_integrity()


def test_multi_turn_extends_history(precise_model, tiny_tokenizer, policy):
    b = make_backend(precise_model, tiny_tokenizer, policy)
    turn1 = prompt(8, 30)
    r1 = run(b, turn1, max_new=10)
    turn2 = turn1 + r1.token_ids + prompt(9, 7)
    warm = run(b, turn2)
    # everything the model saw in turn 1 (prompt + reply except the last sampled token) is reused
    assert warm.cache_hit_tokens == len(turn1) + len(r1.token_ids) - 1
    assert_same(run(b.without_cache(), turn2), warm, b.runner.precision)
    b.cache.check_integrity()


def test_hit_after_eviction_pressure(precise_model, tiny_tokenizer, policy):
    b = make_backend(precise_model, tiny_tokenizer, policy, num_blocks=40)
    keep = prompt(10, 20)
    run(b, keep + prompt(11, 4))
    for seed in range(12, 20):  # far more than the pool holds
        run(b, prompt(seed, 30))
        b.cache.check_integrity()
    stats = b.cache.stats()
    assert stats.eviction_count > 0
    ids = keep + prompt(30, 6)
    warm = run(b, ids)
    assert_same(run(b.without_cache(), ids), warm, b.runner.precision)
    again = run(b, ids)
    assert again.hit_source == "exact"
    assert_same(run(b.without_cache(), ids), again, b.runner.precision)
    b.cache.check_integrity()


def test_hit_after_interruption(precise_model, tiny_tokenizer, policy, monkeypatch):
    b = make_backend(precise_model, tiny_tokenizer, policy, chunk=8)
    ids = prompt(40, 45)
    # interrupted mid-prefill: a KeyboardInterrupt raised inside the third forward
    real = b.runner.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(b.runner, "forward", flaky)
    gen = b.submit(Request(ids, SamplingParams(max_new_tokens=8)))
    with pytest.raises(KeyboardInterrupt):
        list(gen)
    monkeypatch.setattr(b.runner, "forward", real)
    assert gen.result is not None and gen.result.finish_reason == "interrupted"
    assert gen.result.stored_tokens == 16  # the two chunks that completed
    b.cache.check_integrity()
    assert all(blk.ref_count == 0 for blk in b.cache.manager.blocks)
    # interrupted mid-decode: the consumer stops reading (Ctrl-C in the REPL closes the stream)
    gen = b.submit(Request(ids, SamplingParams(max_new_tokens=8)))
    it = iter(gen)
    next(it)
    next(it)
    gen.close()
    assert gen.result is not None and gen.result.finish_reason == "interrupted"
    assert gen.result.cache_hit_tokens == 16
    b.cache.check_integrity()
    warm = run(b, ids)  # the prefill had finished, so its logits were kept: an exact hit
    assert warm.hit_source == "exact" and warm.cache_hit_tokens == len(ids)
    assert_same(run(b.without_cache(), ids), warm, b.runner.precision)


def test_cancel_between_steps_keeps_cache_consistent(tiny_model, tiny_tokenizer):
    b = make_backend(tiny_model, tiny_tokenizer, "lru")
    ids = prompt(50, 20)
    gen = b.submit(Request(ids, SamplingParams(max_new_tokens=50)))
    for i, _ in enumerate(gen):
        if i == 2:
            gen.cancel()
    assert gen.result is not None and gen.result.finish_reason == "interrupted"
    assert len(gen.result.token_ids) < 50
    b.cache.check_integrity()
    assert b.cache.peek(ids + gen.result.token_ids) >= len(ids) + len(gen.result.token_ids) - 1


def test_h2o_scores_and_victims(tiny_model, tiny_tokenizer):
    def scenario(policy: str):
        b = make_backend(tiny_model, tiny_tokenizer, policy, num_blocks=128)
        old, new = prompt(60, 21), prompt(61, 21)
        run(b, old, max_new=6)
        for _ in range(3):  # the old sequence keeps being attended to
            run(b, old, max_new=6)
        run(b, new, max_new=2)  # newest, attended least
        cache = b.cache
        leaves = {leaf.blocks[-1].block_id: leaf for leaf in cache.tree.leaves()}
        owner = {}
        for bid, leaf in leaves.items():
            path = leaf.tokens if leaf.start == 0 else None
            owner[bid] = "old" if path and path[:21] == old else "new"
        before = {bid for bid in leaves}
        assert cache.evict(1) == 1
        gone = [bid for bid in before if cache.manager.is_free(bid)]
        cache.check_integrity()
        return cache, owner, gone

    cache, owner, gone = scenario("h2o")
    scores = [blk.attn_score for blk in cache.tree.all_blocks()]
    assert all(s > 0 for s in scores), "every cached block received attention"
    assert owner[gone[0]] == "new", "h2o evicts the leaf block with the least attention mass"
    _, owner, gone = scenario("lru")
    assert owner[gone[0]] == "old", "lru evicts the least recently used leaf block"


def test_h2o_victim_is_lowest_mass(tiny_model, tiny_tokenizer):
    b = make_backend(tiny_model, tiny_tokenizer, "h2o", num_blocks=128)
    for seed in range(70, 74):
        run(b, prompt(seed, 18 + seed % 3), max_new=4)
    cache = b.cache
    candidates = [
        leaf.blocks[-1] for leaf in cache.tree.leaves()
        if leaf.blocks[-1].ref_count == 0 and not leaf.blocks[-1].is_first_block
    ]
    expected = min(candidates, key=lambda blk: (blk.attn_score, blk.last_accessed))
    assert len({blk.attn_score for blk in candidates}) > 1
    cache.evict(1)
    assert cache.manager.is_free(expected.block_id)


def test_engine_streams_events_and_refuses_bad_requests(tiny_model, tiny_tokenizer):
    b = make_backend(tiny_model, tiny_tokenizer, "lru")
    events: list[object] = []
    a = b.submit(Request(prompt(80, 12), SamplingParams(max_new_tokens=3)), events.append)
    with pytest.raises(KvchatError, match="empty"):
        b.submit(Request([], SamplingParams(max_new_tokens=3)))
    c = b.submit(Request(prompt(80, 12) + [1], SamplingParams(max_new_tokens=3)))
    while not b.idle:
        b.step()
    assert a.result is not None and c.result is not None
    assert c.result.cache_hit_tokens == 12
    assert isinstance(events[-1], Finished) and events[-1].result is a.result
    streamed = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert streamed == a.result.text
    b.cache.check_integrity()


def test_a_failing_row_fails_alone(tiny_model, tiny_tokenizer, monkeypatch):
    """An exception while sampling one row fails that row; the others finish normally."""
    import kvchat.engine.sequence as sequence_module

    b = make_backend(tiny_model, tiny_tokenizer, "lru")
    params = SamplingParams(max_new_tokens=5)
    ids = [prompt(81 + i, 10 + i) for i in range(3)]
    expected = [run(b.without_cache(), p, max_new=5).token_ids for p in ids]
    real = sequence_module.sample
    bad = SamplingParams(max_new_tokens=5, seed=3)

    def sample(logits, p, gen):
        if p is bad and len(p.stop) == 0 and sample.calls == 2:
            raise RuntimeError("boom")
        sample.calls += p is bad
        return real(logits, p, gen)

    sample.calls = 0
    monkeypatch.setattr(sequence_module, "sample", sample)
    handles = [b.submit(Request(ids[0], params)), b.submit(Request(ids[1], bad)),
               b.submit(Request(ids[2], params))]
    while not b.idle:
        b.step()
    assert isinstance(handles[1].error, RuntimeError)
    assert handles[1].result is not None and handles[1].result.finish_reason == "error"
    assert handles[0].result.token_ids == expected[0]
    assert handles[2].result.token_ids == expected[2]
    assert all(blk.ref_count == 0 for blk in b.cache.manager.blocks)
    b.cache.check_integrity()


def test_prompt_longer_than_context_is_a_clear_error(tiny_model, tiny_tokenizer):
    b = make_backend(tiny_model, tiny_tokenizer, "lru")
    with pytest.raises(Exception, match="context"):
        b.submit(Request([5] * (b.max_context + 1)))


def test_sampling_is_seeded(tiny_model, tiny_tokenizer):
    b = make_backend(tiny_model, tiny_tokenizer, "lru")
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    ids = prompt(90, 10)
    one = b.generate(Request(ids, params)).token_ids
    two = b.without_cache().generate(Request(ids, params)).token_ids
    assert one == two


def test_verify_rows(tiny_model, tiny_tokenizer):
    b = make_backend(tiny_model, tiny_tokenizer, "lru")
    rows = verify_prompt(b, prompt(91, 33), "p", max_new_tokens=6)
    assert [r.scenario for r in rows] == ["prefix hit", "exact repeat", "in a batch",
                                          "plain generate"]
    assert rows[0].hit_tokens == 16 and rows[0].source == "radix"
    assert rows[1].source == "exact" and rows[1].hit_tokens == 33
    # the repeat's reply came from the cache's draft of the first warm run's reply
    assert rows[1].draft_accepted > 0
    assert all(r.tokens_equal and r.max_logit_diff == 0.0 and r.ok and r.exact for r in rows)


@pytest.mark.parametrize("precision", QUANTIZED)
def test_verify_rows_quantized(tiny_model, tiny_tokenizer, precision):
    """kvchat's uncached run equals transformers' generate on the same packed model (same
    kernels), and cached and batched runs equal it bitwise."""
    b = make_backend(at_precision(tiny_model, precision), tiny_tokenizer, "lru")
    assert b.runner.precision == precision
    rows = verify_prompt(b, prompt(92, 40), "p", max_new_tokens=8)
    assert all(r.ok and r.exact and r.max_logit_diff == 0.0 for r in rows), rows
    plain = rows[3]
    assert plain.scenario == "plain generate" and plain.tokens_equal


def test_transformers_calls_we_rely_on(tiny_model):
    """Every transformers cache call the engine makes, in one place: if a release changes one,
    this fails first."""
    from transformers import DynamicCache

    from kvchat.engine.past import (
        build_past,
        past_kv,
        past_length,
        reserve,
        reserved_past,
        wrap_past,
    )

    ids = torch.tensor([prompt(92, 12)])
    with torch.inference_mode():
        out = tiny_model(input_ids=ids, use_cache=True, logits_to_keep=1)
        assert out.logits.shape[1] == 1
        past = out.past_key_values
        assert isinstance(past, DynamicCache) and past_length(past) == 12
        kv = past_kv(past, 0, 8)
        rebuilt = build_past(kv, tiny_model.config)
        assert rebuilt.get_seq_length() == 8
        assert torch.equal(rebuilt.layers[0].keys, kv[0][0])
        tail = tiny_model(input_ids=ids[:, 8:], past_key_values=rebuilt, use_cache=True,
                          logits_to_keep=1)
        assert torch.allclose(tail.logits, out.logits, atol=1e-5)
        assert past_length(rebuilt) == 12
        # wrap without copying, then a padded two-row batch with a 2D mask, explicit positions
        # and logits for chosen columns (the batched scheduler's forward)
        wrapped = wrap_past([(k.clone(), v.clone()) for k, v in kv], tiny_model.config)
        assert wrapped.get_seq_length() == 8
        batch_kv = [(torch.cat([k, torch.zeros_like(k)]), torch.cat([v, torch.zeros_like(v)]))
                    for k, v in kv]
        batch = wrap_past(batch_kv, tiny_model.config)
        mask = torch.tensor([[1] * 8 + [1] * 4, [0] * 8 + [1] * 4])
        pos = torch.tensor([[8, 9, 10, 11], [0, 1, 2, 3]])
        two = tiny_model(input_ids=torch.cat([ids[:, 8:], ids[:, :4]]), attention_mask=mask,
                         position_ids=pos, past_key_values=batch, use_cache=True,
                         logits_to_keep=torch.tensor([3]))
        alone = tiny_model(input_ids=ids[:, :4], use_cache=True, logits_to_keep=1)
        assert torch.allclose(two.logits[0, -1], out.logits[0, -1], atol=1e-5)
        assert torch.allclose(two.logits[1, -1], alone.logits[0, -1], atol=1e-5)
        # a reserved buffer: columns written in place; reserve() widens it before a forward
        # that needs more room. One row hands attention its written columns (as a plain cache
        # does); several rows the whole buffer, the unwritten columns masked (a 2-D mask is
        # padded up to the buffer's width)
        buffers = [(torch.cat([k, torch.zeros(1, k.shape[1], 1, k.shape[3])], dim=2),
                     torch.cat([v, torch.zeros(1, v.shape[1], 1, v.shape[3])], dim=2))
                    for k, v in kv]
        reserved = reserved_past(buffers, 8, tiny_model.config)
        assert reserved.get_seq_length() == 8
        assert reserved.get_mask_sizes(4, 0) == (12, 0)
        with pytest.raises(ValueError, match="reserve"):
            tiny_model(input_ids=ids[:, 8:], past_key_values=reserved, use_cache=True)
        reserve(reserved, 4)
        grown = tiny_model(input_ids=ids[:, 8:], past_key_values=reserved, use_cache=True,
                           logits_to_keep=1)
        assert reserved.get_seq_length() == 12
        assert torch.equal(grown.logits, tail.logits)
        rows = [(torch.cat([k, k]), torch.cat([v, v])) for k, v in buffers]
        two_rows = reserved_past(rows, 8, tiny_model.config)
        reserve(two_rows, 4)
        assert two_rows.get_mask_sizes(4, 0) == (13, 0)
        both = tiny_model(input_ids=torch.cat([ids[:, 8:]] * 2),
                          attention_mask=torch.ones(2, 12, dtype=torch.bool),
                          past_key_values=two_rows, use_cache=True, logits_to_keep=1)
        assert torch.allclose(both.logits[1], tail.logits[0], atol=1e-5)
    # the H2O path: an attention function and mask registered once per model, which run the
    # model's own kernel unless a forward asks for attention mass
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from kvchat.engine.attention import PREFIX, attention_mass, track_attention

    base = tiny_model.config._attn_implementation
    track_attention(tiny_model)
    name = f"{PREFIX}:{base}"
    assert tiny_model.config._attn_implementation == name
    assert name in AttentionInterface._global_mapping
    assert name in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    with torch.inference_mode():
        plain = tiny_model(input_ids=ids, use_cache=True, logits_to_keep=1)
        with attention_mass(True) as rows:
            eager = tiny_model(input_ids=ids, use_cache=True, logits_to_keep=1)
    tiny_model.set_attn_implementation(base)
    assert torch.equal(plain.logits, out.logits), "without tracking, the model's own kernel"
    assert torch.allclose(eager.logits, out.logits, atol=1e-5)
    assert rows is not None and len(rows) == tiny_model.config.num_hidden_layers
    # each query's weights sum to 1: the mass over keys is the number of (head, query) pairs
    heads = tiny_model.config.num_attention_heads
    assert torch.allclose(rows[0].sum(), torch.tensor(float(heads * ids.shape[1])), atol=1e-3)


def test_sliding_window_model_keeps_whole_prefixes(tiny_tokenizer):
    """Sliding-window layers (Mistral, Gemma, Phi-3) would drop positions kvchat stores; the
    cache keeps them all and the window comes from the model's mask: same tokens as generate."""
    from transformers import MistralConfig, MistralForCausalLM

    tok = tiny_tokenizer
    cfg = MistralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=2048, sliding_window=8, initializer_range=0.2,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    ids = prompt(93, 20)
    with torch.inference_mode():
        ref = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    expected = ref[0, len(ids):].tolist()
    b = Engine.create(model, tok, CacheConfig(BLOCK, num_blocks=64), batch_size=2)
    first = b.generate(Request(ids, SamplingParams(max_new_tokens=6)))
    assert first.token_ids == expected and first.stored_tokens == len(ids) + 5
    warm = b.generate(Request(ids + expected[:3], SamplingParams(max_new_tokens=3)))
    assert warm.cache_hit_tokens == len(ids) + 2
    assert warm.token_ids == expected[3:6]
    handles = [b.submit(Request(ids, SamplingParams(max_new_tokens=6))) for _ in range(2)]
    while not b.idle:
        b.step()
    assert all(h.result is not None and h.result.token_ids == expected for h in handles)
    b.cache.check_integrity()


@pytest.mark.parametrize("precision", sorted(QUANTIZED))
def test_rows_after_one_header_hold_its_kv_once(tiny_model, tiny_tokenizer, precision,
                                                monkeypatch):
    """Decode rows that all start with the same 75 tokens hold those K/V once (the batch's
    head), drafts are verified through it, and every reply equals the same batch's with each
    row holding its own copy (within the precision's rounding); the cache stays whole."""
    from kvchat.engine import decode_batch

    model = at_precision(tiny_model, precision)
    header = prompt(500, 75)
    prompts = [header + prompt(510 + i, 3 + i) for i in range(4)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    heads: list[int] = []
    rebuild = decode_batch.DecodeBatch._rebuild

    def seen(self):
        rebuild(self)
        heads.append(self._head_len)

    monkeypatch.setattr(decode_batch.DecodeBatch, "_rebuild", seen)
    runs = {}
    for head_min in (10**9, decode_batch.HEAD_MIN):  # every row its own copy, then a head
        monkeypatch.setattr(decode_batch, "HEAD_MIN", head_min)
        b = make_backend(model, tiny_tokenizer, "lru")
        assert b.runner.attends_heads
        first = b.generate(Request(prompts[0], params))
        # a continuation of the first reply: the tree drafts the rest of it
        again = prompts[0] + first.token_ids[:3]
        heads.clear()
        handles = [b.submit(Request(p, params, record_logits=True)) for p in [again, *prompts]]
        while not b.idle:
            b.step()
        results = [h.result for h in handles]
        b.cache.check_integrity()
        # nothing cached yet: each row stores the head's positions from the batch's K/V
        fresh = make_backend(model, tiny_tokenizer, "lru")
        cold = [fresh.submit(Request(p, params, record_logits=True)) for p in prompts[1:]]
        while not fresh.idle:
            fresh.step()
        fresh.cache.check_integrity()
        # a prompt that continues a finished one reads what it stored
        reply = cold[0].result.token_ids
        later = fresh.generate(Request(prompts[1] + reply[:6] + [7], params, record_logits=True))
        assert later.cache_hit_tokens == len(prompts[1]) + 6
        results += [h.result for h in cold] + [later]
        runs[head_min] = results, list(heads)
    (own, no_heads), (held, with_heads) = runs[10**9], runs[decode_batch.HEAD_MIN]
    assert set(no_heads) == {0} and max(with_heads) >= 75
    assert held[0].draft_accepted > 0
    for a, b_ in zip(own, held, strict=True):
        assert_same(a, b_, precision)


@pytest.mark.parametrize("precision", ["int4"])
def test_identical_prompts_decoding_together_are_all_head(tiny_model, tiny_tokenizer,
                                                          precision, monkeypatch):
    """Rows whose every position so far is the same (one prompt decoded several times at
    once: here greedy with drafting off, so none waits for its twin; the later two hit the
    first's stored prompt) have no columns of their own at first; they decode as with their
    own copies."""
    from kvchat.engine import decode_batch

    model = at_precision(tiny_model, precision)
    ids = prompt(600, 80)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    results, held = {}, decode_batch.HEAD_MIN
    for head_min in (10**9, held):
        monkeypatch.setattr(decode_batch, "HEAD_MIN", head_min)
        b = make_backend(model, tiny_tokenizer, "lru")
        b.draft_max = 0
        b.generate(Request(ids, SamplingParams(max_new_tokens=1)))  # cached: the rows share it
        handles = [b.submit(Request(ids + [5], params, record_logits=True)) for _ in range(3)]
        for _ in range(3):  # the first prefills; the others then hit it exactly and join
            b.step()
        assert len(b.batch.rows) == 3
        # the last to join had only the prompt's 81 positions: all of them in the head
        assert b.batch._head_len == (81 if head_min == held else 0)
        while not b.idle:
            b.step()
        results[head_min] = [h.result for h in handles]
        b.cache.check_integrity()
    for a, b_ in zip(results[10**9], results[held], strict=True):
        assert_same(a, b_, precision)


def test_a_head_is_held_only_within_one_namespace_and_for_drafts_it_can_take(
        tiny_model, tiny_tokenizer):
    """Rows of two namespaces never share a head (what one tenant sent does not shape
    another's batch); with a head, drafts are cut to what the fused forward takes, however
    many tokens the engine would draft."""
    from kvchat.engine.decode_attention import SMALL_Q

    model = at_precision(tiny_model, "int4")
    header = prompt(700, 75)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    b = make_backend(model, tiny_tokenizer, "lru")
    heads: list[int] = []
    for k, namespaces in enumerate((("a", "b"), ("a", "a"))):
        heads.clear()  # new prompts each time: an exact repeat would replay, with no row
        handles = [b.submit(Request(header + prompt(710 + 2 * k + i, 4), params, namespace=ns))
                   for i, ns in enumerate(namespaces)]
        while not b.idle:
            b.step()
            if b.batch.rows:
                heads.append(b.batch._head_len)
        assert all(h.result.finish_reason == "length" for h in handles)
        assert max(heads) == (0 if namespaces == ("a", "b") else 75)
    b.draft_max = 3 * SMALL_Q  # more than one forward of the fused path takes
    first = b.generate(Request(header + prompt(720, 4), params))
    again = header + prompt(720, 4) + first.token_ids[:2]  # the tree drafts the other 28
    handles = [b.submit(Request(p, params)) for p in (again, header + prompt(721, 4))]
    while not b.idle:
        b.step()
    assert all(h.result.finish_reason == "length" for h in handles)
    assert handles[0].result.draft_tokens >= SMALL_Q - 1  # drafted, at most 15 a step
    b.cache.check_integrity()
