"""Drafts from the cache: the radix tree's continuation of a sequence, proposed and verified in
one forward. Greedy output with drafts equals greedy output without (and cold output), whether
the draft is right, half right or wrong, alone or in a batch, at every precision."""

from __future__ import annotations

import pytest
from conftest import make_engine

from kvchat.cache.drafts import continuation
from kvchat.cache.radix import RadixTree
from kvchat.config import SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.sequence import Request
from kvchat.models.precision import QUANTIZED
from tests.test_engine import at_precision, prompt


def _tree(*sequences: list[int], namespace: str = "") -> RadixTree:
    from kvchat.cache.blocks import BlockManager

    manager = BlockManager(64, 4, 1, 1, 1)
    tree = RadixTree(4)
    for seq in sequences:
        match = tree.find_prefix(seq, namespace)
        n_blocks = -(-len(seq) // 4)
        blocks = list(match.blocks[: len(seq[: match.matched]) // 4])
        blocks += manager.allocate(n_blocks - len(blocks))
        tree.insert(seq, blocks, namespace=namespace)
    return tree


def test_continuation_follows_the_tree():
    a = list(range(10, 30))  # 20 tokens
    tree = _tree(a)
    assert continuation(tree, a[:7], "", 5) == a[7:12]  # inside an edge
    assert continuation(tree, a[:18], "", 5) == a[18:]  # the edge ends first
    assert continuation(tree, a, "", 5) == []  # nothing after it
    assert continuation(tree, a[:7] + [99], "", 5) == []  # the sequence left the tree
    assert continuation(tree, a[:7], "", 0) == []
    assert continuation(tree, [], "", 5) == []
    assert continuation(tree, a[:7], "tenant-b", 5) == []  # namespaces never draft for another


def test_continuation_descends_into_the_longest_child():
    base = list(range(100, 108))  # two whole blocks
    short, long = base + [1, 2], base + [3, 4, 5, 6, 7, 8, 9]
    tree = _tree(short, long)
    assert continuation(tree, base[:6], "", 6) == base[6:] + [3, 4, 5, 6]
    assert continuation(tree, short[:9], "", 4) == [2]


def _engine(model, tokenizer, batch_size: int = 8) -> Engine:
    """An engine whose exact repeats decode (drafting) instead of replaying a stored reply
    (tests/test_replay.py)."""
    engine = make_engine(model, tokenizer, num_blocks=512, batch_size=batch_size)
    engine.replay = False
    return engine


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n)


@pytest.mark.parametrize("precision", ("float32", "bfloat16", *QUANTIZED))
def test_a_repeat_decodes_from_its_stored_reply(tiny_model, tiny_tokenizer, precision):
    engine = _engine(at_precision(tiny_model, precision), tiny_tokenizer)
    ids = prompt(200, 21)
    first = engine.generate(Request(ids, SamplingParams(max_new_tokens=40, ignore_eos=True)))
    assert first.draft_tokens == 0 and first.decode_forwards == 39
    again = engine.generate(Request(ids, SamplingParams(max_new_tokens=40, ignore_eos=True)))
    assert again.token_ids == first.token_ids
    assert again.hit_source == "exact"
    # the first token comes from the exact hit's logits; each forward then verifies 8 drafted
    # tokens and computes one more: 39 tokens in 5 forwards instead of 39
    assert again.decode_forwards == 5
    assert again.draft_accepted == again.draft_tokens == 39 - 5
    engine.cache.check_integrity()


def test_drafts_change_no_token_when_wrong(tiny_model, tiny_tokenizer):
    """A prompt cached with a continuation the model would not produce: every draft is
    rejected (its columns become holes in the batch) and the output equals decoding without
    drafts and cold decoding, K/V included (a later exact repeat reproduces it)."""
    engine = _engine(tiny_model, tiny_tokenizer)
    ids = prompt(201, 18)
    plain = engine.without_cache().generate(Request(ids, _greedy(24)))
    wrong = ids + plain.token_ids[:1] + prompt(202, 30)
    engine.generate(Request(wrong, _greedy(1)))  # the tree: ids, the first token, then noise
    drafted = engine.generate(Request(ids, _greedy(24)))
    assert drafted.draft_tokens > 0 and drafted.draft_accepted < drafted.draft_tokens
    assert drafted.token_ids == plain.token_ids
    engine.cache.check_integrity()
    # what that run stored (holes skipped) is right: a repeat's stored logits and K/V give the
    # same tokens again
    repeat = engine.generate(Request(ids, _greedy(24)))
    assert repeat.token_ids == plain.token_ids and repeat.hit_source == "exact"
    off = _engine(tiny_model, tiny_tokenizer)
    off.draft_max = 0
    off.generate(Request(wrong, _greedy(1)))
    undrafted = off.generate(Request(ids, _greedy(24)))
    assert undrafted.draft_tokens == 0 and undrafted.token_ids == plain.token_ids


def test_drafts_in_a_batch_with_rows_that_do_not_draft(tiny_model, tiny_tokenizer):
    """Rows with long, short, wrong and no drafts in the same steps: each row's tokens equal
    its own cold run."""
    engine = _engine(tiny_model, tiny_tokenizer, batch_size=4)
    prompts = [prompt(210 + i, 15 + i) for i in range(4)]
    replies = [engine.generate(Request(p, _greedy(20))).token_ids for p in prompts[:2]]
    engine.generate(Request(prompts[2] + prompt(299, 12), _greedy(1)))  # a wrong continuation
    cold = [engine.without_cache().generate(Request(p, _greedy(20))).token_ids for p in prompts]
    handles = [engine.submit(Request(p, _greedy(20))) for p in prompts]
    while not engine.idle:
        engine.step()
    results = [h.result for h in handles]
    assert [r.token_ids for r in results] == cold
    assert [r.token_ids for r in results[:2]] == replies
    assert results[0].draft_accepted > 0 and results[3].draft_tokens == 0
    assert all(b.ref_count == 0 for b in engine.cache.manager.blocks)
    engine.cache.check_integrity()


def test_sampled_rows_never_draft(tiny_model, tiny_tokenizer):
    engine = _engine(tiny_model, tiny_tokenizer)
    ids = prompt(220, 12)
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=5)
    first = engine.generate(Request(ids, params))
    again = engine.generate(Request(ids, params))
    assert again.draft_tokens == 0 and again.token_ids == first.token_ids


def test_h2o_never_drafts(tiny_model, tiny_tokenizer):
    """H2O sums the attention every column received; a rejected draft's columns would count."""
    engine = make_engine(tiny_model, tiny_tokenizer, num_blocks=256, policy="h2o")
    ids = prompt(230, 12)
    engine.generate(Request(ids, _greedy(10)))
    assert engine.generate(Request(ids, _greedy(10))).draft_tokens == 0


def test_a_draft_never_runs_past_max_tokens(tiny_model, tiny_tokenizer):
    engine = _engine(tiny_model, tiny_tokenizer)
    ids = prompt(240, 10)
    long = engine.generate(Request(ids, SamplingParams(max_new_tokens=30, ignore_eos=True)))
    short = engine.generate(Request(ids, SamplingParams(max_new_tokens=5, ignore_eos=True)))
    assert short.token_ids == long.token_ids[:5] and short.finish_reason == "length"
    assert short.draft_tokens <= 3  # 5 tokens: the first from stored logits, at most 3 drafted


def test_a_repeat_submitted_alongside_waits_and_decodes_as_drafts(tiny_model, tiny_tokenizer):
    """Three copies of one greedy request and another request in one batch: the copies wait
    while the first decodes, then draft its stored reply; every row's tokens are its cold ones."""
    engine = _engine(tiny_model, tiny_tokenizer, batch_size=4)
    ids, other = prompt(220, 19), prompt(221, 23)
    _long = SamplingParams(max_new_tokens=30, ignore_eos=True)
    cold = engine.without_cache().generate(Request(ids, _long)).token_ids
    cold_other = engine.without_cache().generate(Request(other, _long)).token_ids
    handles = [engine.submit(Request(p, _long)) for p in (ids, other, ids, ids)]
    most_running = 0
    while not engine.idle:
        engine.step()
        most_running = max(most_running, engine.running)
    first, second, *copies = [h.result for h in handles]
    assert most_running == 2  # the copies never took a row next to the first
    assert first.token_ids == cold and second.token_ids == cold_other
    for copy in copies:
        assert copy.token_ids == cold and copy.hit_source == "exact"
        assert copy.decode_forwards * 4 <= len(copy.token_ids)  # drafted, not decoded
    engine.cache.check_integrity()


def test_sampled_or_uncached_repeats_run_alongside(tiny_model, tiny_tokenizer):
    engine = _engine(tiny_model, tiny_tokenizer, batch_size=4)
    ids = prompt(222, 19)
    sampled = SamplingParams(max_new_tokens=10, temperature=0.8, seed=1)
    for _ in range(2):
        engine.submit(Request(ids, sampled))
    engine.step()
    engine.step()
    assert engine.running == 2
    plain = engine.without_cache()
    for _ in range(2):
        plain.submit(Request(ids, _greedy(10)))
    plain.step()
    assert plain.running == 2


def test_draft_length_fits_the_step():
    from kvchat.engine.drafting import draft_length

    assert draft_length(1, [8], 8) == 8  # one row: 9 query rows, within the budget
    assert draft_length(8, [8] + [0] * 7, 8) == 1  # one drafting row must not pad seven
    assert draft_length(20, [8] * 20, 8) == 8  # a batch of repeats: every query row is real
    assert draft_length(20, [3] * 20, 8) == 3
    assert draft_length(4, [0] * 4, 8) == 0 and draft_length(4, [], 8) == 0
