"""Exact greedy repeats that end on a stored reply (kvchat/engine/replay.py): no forward, and
the same tokens, text, finish and events as a cold run of the same request, at every
precision. Where the stored reply does not reach the request's stop, or the request samples or
records its logits, or the forward is not batch-invariant, the repeat decodes as before."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_engine

from kvchat.cache.exact import ExactIndex
from kvchat.config import SamplingParams
from kvchat.engine.replay import reaches_a_stop
from kvchat.engine.sequence import Finished, Request, TextDelta
from kvchat.models.precision import QUANTIZED
from tests.test_engine import at_precision, prompt


def _engine(model, tokenizer, batch_size: int = 8):
    return make_engine(model, tokenizer, num_blocks=512, batch_size=batch_size)


def _params(n: int, **fields) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **fields)


@pytest.mark.parametrize("precision", ("float32", "bfloat16", *QUANTIZED))
def test_a_repeat_ends_on_the_stored_reply_with_no_forward(tiny_model, tiny_tokenizer,
                                                            precision):
    engine = _engine(at_precision(tiny_model, precision), tiny_tokenizer)
    assert engine.runner.invariant
    ids = prompt(300, 21)
    cold = engine.without_cache().generate(Request(ids, _params(30)))
    first = engine.generate(Request(ids, _params(30)))
    assert first.replayed_tokens == 0 and first.decode_forwards == 29
    steps = engine.steps
    again = engine.generate(Request(ids, _params(30)))
    assert engine.steps == steps  # not one decode step ran
    assert again.decode_forwards == 0 and again.replayed_tokens == 30
    assert again.decode_tokens_per_s == 0.0  # not decoded: no rate
    assert again.hit_source == "exact" and again.computed_tokens == 0
    for run in (first, again):
        assert run.token_ids == cold.token_ids and run.text == cold.text
        assert run.finish_reason == cold.finish_reason == "length"
    assert all(b.ref_count == 0 for b in engine.cache.manager.blocks)
    engine.cache.check_integrity()


def test_a_shorter_repeat_and_a_stop_string_end_where_a_cold_run_does(tiny_model,
                                                                       tiny_tokenizer):
    engine = _engine(tiny_model, tiny_tokenizer)
    plain = engine.without_cache()
    ids = prompt(301, 17)
    engine.generate(Request(ids, _params(30)))
    short = engine.generate(Request(ids, _params(7)))
    assert short.replayed_tokens == 7 and short.decode_forwards == 0
    assert short.token_ids == plain.generate(Request(ids, _params(7))).token_ids
    text = plain.generate(Request(ids, _params(30))).text
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # two characters from the reply's middle
    cut = _params(30, stop=(stop,))
    cold = plain.generate(Request(ids, cut))
    got = engine.generate(Request(ids, cut))
    assert got.replayed_tokens > 0 and got.decode_forwards == 0
    assert (got.text, got.token_ids, got.finish_reason) == \
        (cold.text, cold.token_ids, cold.finish_reason)
    assert got.finish_reason == "stop"


def test_a_stored_eos_ends_a_repeat_that_asks_for_more(tiny_model, tiny_tokenizer):
    """A reply that held an EOS stops any request that honours EOS within it."""
    engine = _engine(tiny_model, tiny_tokenizer)
    ids = prompt(302, 19)
    reply = engine.generate(Request(ids, _params(20))).token_ids
    engine.codec.eos_ids = frozenset({reply[9]})  # as if the model's EOS came tenth
    plain = engine.without_cache()
    honour = SamplingParams(max_new_tokens=64)
    cold = plain.generate(Request(ids, honour))
    got = engine.generate(Request(ids, honour))
    assert got.decode_forwards == 0 and got.replayed_tokens == len(cold.token_ids)
    assert (got.token_ids, got.text, got.finish_reason) == \
        (cold.token_ids, cold.text, cold.finish_reason)
    assert got.finish_reason == "stop" and len(got.token_ids) <= 10


def test_a_repeat_asking_past_the_stored_reply_decodes(tiny_model, tiny_tokenizer):
    engine = _engine(tiny_model, tiny_tokenizer)
    ids = prompt(303, 15)
    engine.generate(Request(ids, _params(12)))
    longer = engine.generate(Request(ids, _params(25)))
    assert longer.replayed_tokens == 0 and longer.decode_forwards > 0
    assert longer.draft_accepted > 0  # the stored reply was drafted and verified instead
    cold = engine.without_cache().generate(Request(ids, _params(25)))
    assert longer.token_ids == cold.token_ids
    # the longer reply is now the stored one: the next repeat of either length replays
    for n in (12, 25):
        again = engine.generate(Request(ids, _params(n)))
        assert again.replayed_tokens == n and again.token_ids == cold.token_ids[:n]
    engine.cache.check_integrity()


def test_sampled_recorded_uninvariant_or_switched_off_repeats_decode(tiny_model,
                                                                      tiny_tokenizer):
    engine = _engine(tiny_model, tiny_tokenizer)
    ids = prompt(304, 16)
    engine.generate(Request(ids, _params(10)))
    sampled = engine.generate(Request(ids, _params(10, temperature=0.7, seed=3)))
    assert sampled.replayed_tokens == 0 and sampled.decode_forwards > 0
    recorded = engine.generate(Request(ids, _params(10), record_logits=True))
    assert recorded.replayed_tokens == 0 and len(recorded.step_logits) == 10
    engine.replay = False
    assert engine.generate(Request(ids, _params(10))).replayed_tokens == 0
    engine.replay = True
    assert engine.generate(Request(ids, _params(10))).replayed_tokens == 10
    h2o = make_engine(tiny_model, tiny_tokenizer, num_blocks=256, policy="h2o")
    assert not h2o.runner.invariant
    h2o.generate(Request(ids, _params(10)))
    assert h2o.generate(Request(ids, _params(10))).replayed_tokens == 0


def test_repeats_submitted_together_wait_then_replay(tiny_model, tiny_tokenizer):
    """Copies of a greedy request in one batch wait while the first decodes, then end on its
    reply; their streamed text is their result's, and it equals the cold run's."""
    engine = _engine(tiny_model, tiny_tokenizer, batch_size=4)
    ids, other = prompt(305, 19), prompt(306, 23)
    cold = engine.without_cache().generate(Request(ids, _params(30)))
    events: dict[int, list] = {}
    handles = [engine.submit(Request(p, _params(30)), events.setdefault(i, []).append)
               for i, p in enumerate((ids, other, ids, ids))]
    while not engine.idle:
        engine.step()
    first, _, *copies = [h.result for h in handles]
    assert first.token_ids == cold.token_ids
    for i, copy in enumerate(copies, start=2):
        assert copy.token_ids == cold.token_ids and copy.text == cold.text
        assert copy.replayed_tokens == 30 and copy.decode_forwards == 0
        streamed = "".join(e.text for e in events[i] if isinstance(e, TextDelta))
        assert streamed == cold.text and isinstance(events[i][-1], Finished)
    assert all(b.ref_count == 0 for b in engine.cache.manager.blocks)
    engine.cache.check_integrity()


def _decoded_and_saved(model, tokenizer, tmp_path, ids):
    """A greedy reply to `ids` in a runtime that then saves and closes: (the result, the
    snapshot's index.json)."""
    from conftest import make_runtime

    first = make_runtime(model, tokenizer, tmp_path, num_blocks=200)
    cold = first.engine.generate(Request(ids, _params(12)))
    first.save()
    first.close()
    return cold, json.loads((tmp_path / "cache" / "index.json").read_text())


def test_a_reply_is_saved_with_its_entry_and_replays_after_a_restart(tiny_model, tiny_tokenizer,
                                                                       tmp_path):
    """The snapshot keeps each exact entry's reply beside its logits; the fingerprint pins the
    weights and the numerics, so the restarted process would decode the same reply."""
    from conftest import make_runtime

    ids = prompt(308, 18)
    cold, index = _decoded_and_saved(tiny_model, tiny_tokenizer, tmp_path, ids)
    assert [e["reply"] for e in index["exact"]] == [cold.token_ids]
    again = make_runtime(tiny_model, tiny_tokenizer, tmp_path, num_blocks=200)
    assert again.notice is None
    got = again.engine.generate(Request(ids, _params(12)))
    assert got.hit_source == "exact" and got.replayed_tokens == 12 and got.decode_forwards == 0
    assert got.token_ids == cold.token_ids
    again.cache.check_integrity()
    again.close()


def test_a_saved_reply_replays_only_beside_the_row_it_began_from(tiny_model, tiny_tokenizer,
                                                                 tmp_path):
    """The index names the digest of the logits row each reply began from; a logits file
    holding other bits (written by an earlier save, before the entry's row changed) is still
    an exact hit, but its reply is not replayed: the request decodes."""
    from conftest import make_runtime
    from safetensors.torch import load_file, save_file

    from kvchat.cache.exact import row_digest

    ids = prompt(310, 18)
    cold, index = _decoded_and_saved(tiny_model, tiny_tokenizer, tmp_path, ids)
    (entry,) = index["exact"]
    path = next((tmp_path / "cache").rglob(f"{entry['logits']}.safetensors"))
    row = load_file(str(path))["logits"]
    assert entry["row"] == row_digest(row)
    other = row.clone()
    other[other.argmin()] -= 1.0  # other bits, the same greedy first token
    save_file({"logits": other}, str(path))
    again = make_runtime(tiny_model, tiny_tokenizer, tmp_path, num_blocks=200)
    got = again.engine.generate(Request(ids, _params(12)))
    assert got.hit_source == "exact" and got.replayed_tokens == 0 and got.decode_forwards > 0
    assert got.token_ids[0] == cold.token_ids[0]
    again.cache.check_integrity()
    again.close()


def test_a_reply_waits_with_its_entry_while_the_blocks_are_on_disk(tiny_model, tiny_tokenizer,
                                                                    tmp_path):
    from conftest import make_runtime

    rt = make_runtime(tiny_model, tiny_tokenizer, tmp_path, num_blocks=200)
    ids = prompt(309, 18)
    cold = rt.engine.generate(Request(ids, _params(12)))
    rt.cache.evict(rt.cache.manager.num_blocks)  # spilled to the disk tier, the entry parked
    assert not rt.cache.exact.has(ids)
    assert rt.cache.exact.saved_reply(ids)[0] == tuple(cold.token_ids)
    got = rt.engine.generate(Request(ids, _params(12)))
    assert got.hit_source == "exact" and got.disk_hit_tokens > 0
    assert got.replayed_tokens == 12 and got.token_ids == cold.token_ids
    rt.cache.check_integrity()
    rt.close()


def test_two_replies_that_disagree_leave_none():
    row = torch.tensor([0.5, 2.0, -1.0])
    index = ExactIndex()
    index.put([1, 2, 3], [], logits=row)
    assert index.remember_reply([1, 2, 3], "", [7, 8], row)
    assert index.remember_reply([1, 2, 3], "", [7], row)  # a shorter one agrees: the longer stays
    assert index.get([1, 2, 3]).reply == (7, 8)
    assert index.remember_reply([1, 2, 3], "", [7, 8, 9], row.clone())
    assert index.get([1, 2, 3]).reply == (7, 8, 9)
    assert not index.remember_reply([1, 2, 3], "", [7, 5], row)
    assert index.get([1, 2, 3]).reply == ()
    assert index.remember_reply([4], "", [1], row)  # no entry: nothing kept, nothing wrong
    assert not index.has([4])
    index.remember_reply([1, 2, 3], "", [7], row)
    assert index.get([1, 2, 3], "tenant-b") is None  # a reply is its namespace's only


def test_a_reply_is_kept_only_with_the_logits_it_began_from():
    row, other = torch.tensor([0.5, 2.0]), torch.tensor([0.5, 2.5])
    index = ExactIndex()
    index.put([1, 2], [], logits=row)
    index.remember_reply([1, 2], "", [1, 0], other)  # another run's logits: not this entry's
    assert index.get([1, 2]).reply == ()
    index.remember_reply([1, 2], "", [1, 0], row)
    index.put([1, 2], [], logits=row.clone())  # stored again from the same bits: kept
    assert index.get([1, 2]).reply == (1, 0)
    index.put([1, 2], [], logits=other)  # from other bits: dropped
    assert index.get([1, 2]).reply == ()


def test_repeats_that_decode_or_sample_keep_the_stored_reply(tiny_model, tiny_tokenizer):
    """A sampled repeat, or one that records its logits, stores the prompt again as it ends:
    the stored reply stays whole, and the next greedy repeat still replays all of it."""
    engine = _engine(tiny_model, tiny_tokenizer)
    ids = prompt(307, 14)
    first = engine.generate(Request(ids, _params(30)))
    engine.generate(Request(ids, _params(30, temperature=0.9, seed=2)))
    engine.generate(Request(ids, _params(5), record_logits=True))
    again = engine.generate(Request(ids, _params(30)))
    assert again.replayed_tokens == 30 and again.token_ids == first.token_ids


@pytest.mark.parametrize(("reply", "max_new", "ignore_eos", "prompt_len", "reaches"), [
    ((5, 6, 2), 50, False, 10, True),  # holds an EOS (2)
    ((5, 6, 2), 50, True, 10, False),  # ... that the request ignores
    ((5, 6, 7), 3, False, 10, True),  # as long as max_tokens
    ((5, 6, 7), 4, False, 10, False),
    ((5, 6, 7), 50, False, 97, True),  # reaches the context (100)
    ((5, 6, 7), 50, False, 96, False),
])
def test_a_stored_reply_reaches_a_stop(reply, max_new, ignore_eos, prompt_len, reaches):
    assert reaches_a_stop(reply, max_new, ignore_eos, frozenset({2}), prompt_len, 100) \
        is reaches
