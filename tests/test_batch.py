"""Batch files: every input format, output format, bad lines, session chaining, input order,
and batched == sequential == model.generate greedy outputs over a whole file."""

from __future__ import annotations

import io
import json

import pytest
import torch
from conftest import make_engine

from kvchat.batch import (
    BatchRun,
    LineError,
    RowWriter,
    parse_line,
    read_batch,
    result_row,
)
from kvchat.config import SamplingParams
from kvchat.engine.engine import Engine
from kvchat.sessions import SessionStore

SYSTEM = "You answer in one short sentence and never more."


def backend(model, tokenizer, blocks: int = 600) -> Engine:
    return make_engine(model, tokenizer, num_blocks=blocks)


def write_file(tmp_path, rows: list[object]) -> object:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_parse_every_input_format():
    a = parse_line('{"prompt": "hi", "id": 7, "max_tokens": 3, "system": "s"}', 1)
    assert (a.id, a.messages, a.max_tokens, a.system) == ("7", [{"role": "user", "content": "hi"}],
                                                          3, "s")
    b = parse_line(json.dumps({"messages": [{"role": "system", "content": "x"},
                                            {"role": "user", "content": "y"}],
                               "temperature": 0.5, "seed": 3, "session": "s1"}), 2)
    assert b.session == "s1" and b.temperature == 0.5 and b.seed == 3 and b.id == "line-2"
    c = parse_line(json.dumps({"custom_id": "req-1", "method": "POST",
                               "url": "/v1/chat/completions",
                               "body": {"model": "m", "messages": [{"role": "user",
                                                                    "content": "q"}],
                                        "max_tokens": 5, "temperature": 0}}), 3)
    assert c.openai and c.custom_id == "req-1" and c.max_tokens == 5 and c.temperature == 0.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt": "x"', "invalid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"prompt": 5}', "must be a string"),
        ('{"prompt": "x", "max_tokens": "9"}', "must be an integer"),
        ('{"prompt": "x", "max_tokens": true}', "must be an integer"),
        ('{"prompt": "x", "colour": "red"}', "unknown field"),
        ('{"prompt": "x", "messages": []}', "exactly one"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "role must be"),
        ('{"messages": "hello"}', "non-empty list"),
        ('{"prompt": "x", "session": "../up"}', "Invalid session name"),
        ('{"custom_id": "a", "url": "/v1/embeddings", "body": {"messages": []}}',
         "unsupported url"),
    ],
)
def test_bad_lines_are_reported(text, message):
    with pytest.raises(LineError, match=message):
        parse_line(text, 1)


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ({"promt": "hi"}, 'unknown field "promt" (did you mean "prompt"?)'),
        ({"prompt": "hi", "max_token": 5},
         'unknown field "max_token" (did you mean "max_tokens"?)'),
        ({"prompt": "hi", "colour": "red", "sesion": "a"},
         'unknown fields "colour", "sesion" (did you mean "session"?)'),
        ({"custom_id": "r", "body": {"messages": []}, "metod": "POST"},
         'unknown field "metod" (did you mean "method"?)'),
    ],
)
def test_an_unknown_field_is_named_with_the_field_it_looks_like(line, named):
    with pytest.raises(LineError) as caught:
        parse_line(json.dumps(line), 1)
    assert str(caught.value).startswith(named), str(caught.value)
    assert "exactly one" not in str(caught.value)


def test_a_bad_lines_row_carries_the_lines_own_id(tmp_path):
    from kvchat.batch.output import bad_line_row

    path = write_file(tmp_path, [{"id": "q7", "promt": "hi"}, {"id": 9, "prompt": 5},
                                 {"promt": "no id"}, "{oops"])
    items, errors = read_batch(path)
    assert items == []
    assert [bad_line_row(e)["id"] for e in errors] == ["q7", "9", "line-3", "line-4"]


def test_read_batch_skips_blank_and_reports_bad_lines(tmp_path):
    path = write_file(tmp_path, [{"prompt": "a"}, "", "{oops", {"prompt": "b"}])
    items, errors = read_batch(path)
    assert [i.line for i in items] == [1, 4]
    assert [e.line for e in errors] == [3] and "invalid JSON" in errors[0].message
    assert items[0].digest and items[0].digest != items[1].digest


def test_a_json_error_at_the_end_of_a_line_names_its_column_on_that_line(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "a"}\r\n{"prompt": "missing brace", "max_tokens": 4\r\n')
    _, errors = read_batch(path)
    assert [e.line for e in errors] == [2]
    assert errors[0].message == "invalid JSON (Expecting ',' delimiter at column 44)"


def test_a_line_that_is_not_utf8_fails_alone(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n{"prompt": "b"}\n')
    items, errors = read_batch(path)
    assert [i.line for i in items] == [1, 3]
    assert [e.line for e in errors] == [2] and "not UTF-8" in errors[0].message


def run_file(b: Engine, path, batch_size: int = 4, max_new: int = 6, **kw) -> BatchRun:
    items, errors = read_batch(path)
    assert not errors
    b.batch_size = batch_size
    store = SessionStore(path.parent / "sessions")
    run = BatchRun(b, items, SamplingParams(max_new_tokens=max_new), store, **kw)
    run.run()
    return run


def sample_file(tmp_path):
    rows: list[object] = []
    for k in range(6):
        rows.append({"id": f"q{k}", "system": SYSTEM, "prompt": f"What is {k} plus {k}?"})
    rows.append({"id": "rep", "system": SYSTEM, "prompt": "What is 1 plus 1?"})
    rows.append({"custom_id": "oa", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": [{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": "Name a colour."}],
                          "max_tokens": 4}})
    return write_file(tmp_path, rows)


def test_batched_equals_sequential_equals_generate(tiny_model, tiny_tokenizer, tmp_path):
    path = sample_file(tmp_path)
    batched = run_file(backend(tiny_model, tiny_tokenizer), path, batch_size=4).ordered()
    sequential = run_file(backend(tiny_model, tiny_tokenizer), path, batch_size=1).ordered()
    assert [r.result.token_ids for r in batched] == [r.result.token_ids for r in sequential]
    b = backend(tiny_model, tiny_tokenizer)
    eos = tiny_tokenizer.eos_token_id
    items, _ = read_batch(path)
    for item, res in zip(items, batched, strict=True):
        prompt = b.codec.encode_chat(item.messages if item.openai else
                               [{"role": "system", "content": SYSTEM}, *item.messages])
        assert res.result.prompt_tokens == len(prompt)
        with torch.inference_mode():
            out = tiny_model.generate(input_ids=torch.tensor([prompt]),
                                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      max_new_tokens=item.max_tokens or 6, do_sample=False,
                                      eos_token_id=eos, pad_token_id=eos)
        assert res.result.token_ids == out[0, len(prompt):].tolist(), item.id
    # the shared system prompt was reused; the repeated question was an exact hit
    assert all(r.result.cache_hit_tokens > 0 for r in batched[1:])


def test_output_formats_keep_input_order(tiny_model, tiny_tokenizer, tmp_path):
    run = run_file(backend(tiny_model, tiny_tokenizer), sample_file(tmp_path), batch_size=3)
    buf = io.StringIO()
    results = run.ordered()
    writer = RowWriter([r.item.line for r in results], None, buf)
    for r in reversed(results):  # finishing in any order, printed in input order
        writer.write(r.item.line, result_row(r))
    writer.close()
    rows = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert [r["line"] for r in rows] == sorted(r.item.line for r in results)
    assert [r.get("id") for r in rows[:7]] == [f"q{k}" for k in range(6)] + ["rep"]
    plain = rows[0]
    assert set(plain) >= {"id", "text", "prompt_tokens", "completion_tokens", "cache_hit_tokens",
                          "hit_source", "ttft_ms", "total_ms"}
    oa = rows[7]
    assert oa["custom_id"] == "oa" and oa["error"] is None
    body = oa["response"]["body"]
    assert body["object"] == "chat.completion"
    usage = body["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert usage["completion_tokens"] <= 4
    assert body["choices"][0]["message"]["role"] == "assistant"


def test_sessions_chain_lines_like_a_repl(tiny_model, tiny_tokenizer, tmp_path):
    rows = [
        {"id": "a1", "session": "alice", "system": SYSTEM, "prompt": "Hello."},
        {"id": "b1", "session": "bob", "prompt": "Hi there."},
        {"id": "a2", "session": "alice", "prompt": "And then?"},
        {"id": "x", "prompt": "Unrelated."},
        {"id": "a3", "session": "alice", "prompt": "Last one."},
    ]
    run = run_file(backend(tiny_model, tiny_tokenizer), write_file(tmp_path, rows), batch_size=4)
    res = {r.item.id: r.result for r in run.ordered()}
    alice = run.sessions.open("alice")
    assert [m["content"] for m in alice.messages if m["role"] == "user"] == [
        "Hello.", "And then?", "Last one."]
    # each later turn extends the previous turn's prompt + reply, all of it cached
    assert res["a2"].cache_hit_tokens == res["a1"].prompt_tokens + len(res["a1"].token_ids) - 1
    assert res["a3"].cache_hit_tokens == res["a2"].prompt_tokens + len(res["a2"].token_ids) - 1
    assert len(alice.tokens) == res["a3"].prompt_tokens + len(res["a3"].token_ids)
    assert len(run.sessions.open("bob").turns) == 1
    # sessions are saved like chat sessions: a new store (a later run) continues them
    assert len(SessionStore(tmp_path / "sessions").open("alice").turns) == 3


def test_failed_lines_do_not_stop_the_rest(tiny_model, tiny_tokenizer, tmp_path):
    b = backend(tiny_model, tiny_tokenizer)
    long = "word " * (b.max_context + 10)
    rows = [{"prompt": "ok one"}, {"prompt": long}, {"prompt": "x" + long},
            {"prompt": "ok two"}]
    run = run_file(b, write_file(tmp_path, rows))
    out = run.ordered()
    assert [r.error is None for r in out] == [True, False, False, True]
    assert "context" in (out[1].error or "") and "context" in (out[2].error or "")
    assert run.progress.failed == 2
    b.cache.check_integrity()


def test_fail_fast_stops_at_first_failure(tiny_model, tiny_tokenizer, tmp_path):
    b = backend(tiny_model, tiny_tokenizer)
    rows = [{"prompt": "word " * (b.max_context + 10)}] + [{"prompt": f"p{k}"} for k in range(6)]
    run = run_file(b, write_file(tmp_path, rows), batch_size=2, fail_fast=True)
    assert run.stopped and run.progress.failed == 1
    assert len(run.ordered()) < len(rows)
    b.cache.check_integrity()
    assert all(blk.ref_count == 0 for blk in b.cache.manager.blocks)



def test_a_line_outside_a_session_is_tokenised_once(tiny_model, tiny_tokenizer, tmp_path,
                                                    monkeypatch):
    from kvchat.batch.run import prepare_independent

    rows = [{"id": "a", "system": SYSTEM, "prompt": "What is 2 plus 2?"},
            {"id": "s", "session": "chain", "prompt": "Hello."},
            {"id": "b", "prompt": "Name a colour."}]
    path = write_file(tmp_path, rows)
    b = backend(tiny_model, tiny_tokenizer)
    items, _ = read_batch(path)
    params = SamplingParams(max_new_tokens=6)
    prepared = prepare_independent(b.codec, items, params)
    assert sorted(prepared) == [1, 3]  # a session line waits for its history
    assert b.codec.decode(prepared[1].prompt_ids[:40], skip_special_tokens=False).count(
        SYSTEM[:20]) == 1  # the line's system prompt is in the prompt the size is chosen from
    encoded: list[object] = []
    real = b.codec.encode_chat
    monkeypatch.setattr(b.codec, "encode_chat", lambda msgs: encoded.append(msgs) or real(msgs))
    b.batch_size = 4
    run = BatchRun(b, items, params, SessionStore(tmp_path / "first"), prepared=prepared)
    run.run()
    assert encoded == []  # no line outside a session was tokenised again
    assert prepared == {}  # submitted lines' turns are not kept for the rest of the run
    again = run_file(backend(tiny_model, tiny_tokenizer), path)  # prepared as it submits
    assert [r.result.token_ids for r in run.ordered()] == \
        [r.result.token_ids for r in again.ordered()]


def test_a_session_line_cut_short_stays_out_of_its_session_and_resume_matches_a_whole_run(
        tiny_model, tiny_tokenizer, tmp_path):
    """A batch stopped while a session's second line decodes: that line's row is cut short
    and its turn is not saved, so running the unfinished lines again (what --resume does) on
    the same sessions gives the rows and the conversation an uninterrupted run gives."""
    from kvchat.engine.sequence import Finished

    rows = [{"session": "cy", "prompt": f"Turn {k}: tell me about the number {k}."}
            for k in range(3)]
    path = write_file(tmp_path, rows)
    items, _ = read_batch(path)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    whole_store = SessionStore(tmp_path / "whole")
    whole = BatchRun(backend(tiny_model, tiny_tokenizer), items, params, whole_store)
    whole.run()

    store = SessionStore(tmp_path / "cut")
    engine = backend(tiny_model, tiny_tokenizer)
    cut = BatchRun(engine, items, params, store)
    event = cut._event

    def stop_in_line_2(item, turn, ev):  # Ctrl-C once line 2 has a token
        if item.line == 2 and not isinstance(ev, Finished):
            cut.stop()
        event(item, turn, ev)

    cut._event = stop_in_line_2
    cut.run()
    first, second = cut.ordered()
    assert first.result.finish_reason == "length" and second.cut_short
    assert 3 not in cut.results and cut.progress.cut_short == 1
    on_disk = SessionStore(tmp_path / "cut").open("cy", create=False)
    assert on_disk.messages == whole_store.open("cy").messages[:2]  # line 1's turn alone

    rest = BatchRun(backend(tiny_model, tiny_tokenizer), items[1:], params,
                    SessionStore(tmp_path / "cut"))
    rest.run()
    assert [r.result.token_ids for r in rest.ordered()] == \
        [r.result.token_ids for r in whole.ordered()[1:]]
    assert SessionStore(tmp_path / "cut").open("cy", create=False).messages == \
        whole_store.open("cy").messages
