"""The end of a turn (`kvchat.turns.finish`), the same for chat, batch and the server: a result
commits to the session's history and the session is saved, then the pin runs; a failure or a
cancelled request aborts the turn and leaves the session as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.config import SamplingParams
from kvchat.engine.codec import ChatCodec
from kvchat.engine.handle import RequestCancelled
from kvchat.engine.sequence import Finished, GenerationResult
from kvchat.errors import KvchatError
from kvchat.sessions import Session, SessionStore
from kvchat.turns import PreparedTurn, finish, prepare_turn, refused, system_tokens

PARAMS = SamplingParams(max_new_tokens=4)


def result(codec: ChatCodec, text: str = " hi", reason: str = "stop") -> GenerationResult:
    ids = codec.encode(text)
    return GenerationResult(text=text, token_ids=ids, prompt_tokens=10, cache_hit_tokens=4,
                            hit_source="radix", computed_tokens=6, prefill_ms=1.5, ttft_ms=2.0,
                            decode_tokens_per_s=50.0, total_ms=9.0, finish_reason=reason,
                            stored_tokens=10 + len(ids))


class FailingStore:
    saves = 0

    def save(self, session: Session) -> None:
        self.saves += 1
        raise KvchatError("Cannot write session 's': no space left on device.")


@pytest.fixture
def codec(tiny_tokenizer) -> ChatCodec:
    return ChatCodec(tiny_tokenizer)


def _session_turn(codec: ChatCodec, store: SessionStore, system: str | None = "Be brief."
                  ) -> tuple[Session, PreparedTurn]:
    session = store.open("s")
    turn = prepare_turn(codec, [{"role": "user", "content": "hello"}], PARAMS, session, system)
    return session, turn


def test_a_result_commits_the_turn_saves_the_session_then_pins(codec, tmp_path: Path):
    store = SessionStore(tmp_path)
    session, turn = _session_turn(codec, store)
    seen: list[tuple[int, int]] = []  # (turns recorded, turns on disk) when the pin ran

    def pin(r: GenerationResult) -> None:
        seen.append((len(session.turns), len(store.load("s").turns)))

    r = result(codec)
    outcome = finish(turn, Finished(r), store, pin)
    assert outcome.result is r and outcome.error is None and outcome.save_error is None
    assert session.turns == [outcome.turn]
    assert session.messages == [{"role": "user", "content": "hello"},
                                {"role": "assistant", "content": " hi"}]
    assert session.tokens == turn.prompt_ids + r.token_ids
    on_disk = store.load("s")
    assert (on_disk.system, on_disk.messages, on_disk.tokens) == (
        "Be brief.", session.messages, session.tokens)
    assert seen == [(1, 1)]  # the pin runs once, after the commit and the save


def test_an_interrupted_reply_is_committed_too(codec, tmp_path: Path):
    store = SessionStore(tmp_path)
    session, turn = _session_turn(codec, store)
    outcome = finish(turn, Finished(result(codec, reason="interrupted")), store)
    assert outcome.turn is not None and outcome.turn.finish_reason == "interrupted"
    assert len(store.load("s").turns) == 1


def test_a_turn_that_keeps_no_interrupted_reply_leaves_its_session_as_it_was(codec,
                                                                              tmp_path: Path):
    """A batch line cut short (or a /generate with "keep_interrupted": false): its reply is
    the outcome's, the session is as before the turn was prepared; a finished reply still
    commits."""
    store = SessionStore(tmp_path)
    session, turn = _session_turn(codec, store)
    assert session.system == "Be brief."  # preparing set the system prompt
    turn.keep_interrupted = False
    cut = result(codec, reason="interrupted")
    pinned: list[GenerationResult] = []
    outcome = finish(turn, Finished(cut), store, pinned.append)
    assert outcome.result is cut and outcome.turn is None and outcome.error is None
    assert pinned == [cut]  # what it cached is pinned as asked all the same
    assert (session.system, session.messages, session.tokens) == (None, [], [])
    session, turn = _session_turn(codec, store)
    turn.keep_interrupted = False
    assert finish(turn, Finished(result(codec)), store).turn is not None
    assert len(store.load("s").turns) == 1


@pytest.mark.parametrize("error", [RuntimeError("the forward pass failed"),
                                   RequestCancelled("cancelled before it started"), None])
def test_a_failed_or_cancelled_turn_aborts_and_changes_nothing(codec, tmp_path: Path, error):
    store = SessionStore(tmp_path)
    session, turn = _session_turn(codec, store)
    assert session.system == "Be brief."  # preparing set the system prompt
    pinned: list[GenerationResult] = []
    outcome = finish(turn, Finished(None, error), store, pinned.append)
    assert outcome.result is None and outcome.error is error and outcome.turn is None
    assert (session.system, session.messages, session.tokens, session.turns) == (
        None, [], [], [])
    assert not store.path("s").exists() and pinned == []


def test_an_error_with_a_partial_result_still_aborts(codec, tmp_path: Path):
    store = SessionStore(tmp_path)
    session, turn = _session_turn(codec, store)
    outcome = finish(turn, Finished(result(codec), RuntimeError("sampling failed")), store)
    assert outcome.result is None and session.turns == [] and session.tokens == []


def test_a_refused_turn_is_aborted(codec, tmp_path: Path):
    store = SessionStore(tmp_path)
    session, turn = _session_turn(codec, store)
    error = KvchatError("The prompt is longer than the model's context.")
    outcome = refused(turn, error)
    assert outcome == (None, error, None, None)
    assert session.system is None and not store.path("s").exists()


def test_a_failed_save_keeps_the_turn_and_says_why(codec, tmp_path: Path):
    session, turn = _session_turn(codec, SessionStore(tmp_path))
    store = FailingStore()
    pinned: list[GenerationResult] = []
    outcome = finish(turn, Finished(result(codec)), store, pinned.append)
    assert store.saves == 1
    assert outcome.save_error == "Cannot write session 's': no space left on device."
    assert session.turns == [outcome.turn] and pinned == [outcome.result]


def test_without_a_store_the_caller_saves(codec, tmp_path: Path):
    store = SessionStore(tmp_path)
    session, turn = _session_turn(codec, store)
    outcome = finish(turn, Finished(result(codec)))
    assert session.turns == [outcome.turn] and not store.path("s").exists()


def test_a_turn_without_a_session_records_nothing(codec):
    turn = prepare_turn(codec, [{"role": "user", "content": "hello"}], PARAMS)
    outcome = finish(turn, Finished(result(codec)), FailingStore())
    assert outcome.turn is None and outcome.save_error is None and outcome.result is not None


def test_the_system_prompt_is_worked_out_once_on_the_prepared_turn(codec, tmp_path: Path):
    msgs = [{"role": "system", "content": "From the messages."},
            {"role": "user", "content": "hello"}]
    assert prepare_turn(codec, msgs, PARAMS, system="Given apart.").system == \
        "From the messages."  # the prompt holds the messages' own
    plain = prepare_turn(codec, msgs[1:], PARAMS, system="Given apart.")
    assert plain.system == "Given apart."
    assert prepare_turn(codec, msgs[1:], PARAMS).system is None
    store = SessionStore(tmp_path)
    session, turn = _session_turn(codec, store, system=None)
    assert turn.system is None
    session.system = "Kept."  # a later turn continues the session's own
    later = prepare_turn(codec, [{"role": "user", "content": "again"}], PARAMS, session)
    assert later.system == "Kept."
    tokens = plain.system_tokens(codec)
    assert tokens == system_tokens(codec, "Given apart.", plain.prompt_ids)
    assert plain.prompt_ids[: len(tokens)] == tokens
    assert "Given apart." in codec.decode(tokens, skip_special_tokens=False)
