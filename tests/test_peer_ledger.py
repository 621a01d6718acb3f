"""This client's record of what it sent a remote engine (`kvchat.client.ledger`): a tree of
messages with what the engine reported for each request, its closest match for a new prompt,
kept bounded and private on disk, and the sentences and tree drawn from it."""

from __future__ import annotations

import io
import stat

from rich.console import Console

from kvchat.client import ledger as ledger_module
from kvchat.client.ledger import Ledger, ledger_path
from kvchat.client.openai_http import Usage
from kvchat.ui.peer_view import explain_line, sent_tree

SYS = {"role": "system", "content": "You are terse."}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def render(renderable: object) -> str:
    out = io.StringIO()
    Console(file=out, width=160, color_system=None).print(renderable)
    return out.getvalue()


def test_requests_share_their_messages_and_keep_what_was_reported(tmp_path) -> None:
    ledger = Ledger(tmp_path / "l.json", "vLLM", "http://h:1")
    ledger.record([SYS, user("waves?")], Usage(30, 4, 0), at=1.0)
    ledger.record([SYS, user("tides?")], Usage(31, 4, 22), at=2.0)
    ledger.record([SYS, user("tides?")], Usage(31, 4, None), at=3.0)
    [root] = ledger.roots
    assert (root.content, root.sent, root.last) == ("You are terse.", 3, 3.0)
    waves, tides = root.children
    assert (waves.sent, [r.cached_tokens for r in waves.reports]) == (1, [0])
    assert (tides.sent, [r.cached_tokens for r in tides.reports]) == (2, [22, None])


def test_closest_finds_whole_messages_then_characters_of_the_next(tmp_path) -> None:
    ledger = Ledger(tmp_path / "l.json", "llama.cpp", "http://h:1")
    ledger.record([SYS, user("What is a tide?")], Usage(30, 4, 12), at=5.0)
    match = ledger.closest([SYS, user("What is a wave?")])
    assert (match.messages, match.total_messages, match.chars) == (1, 2, len("What is a "))
    assert (match.sent_next, match.prompt_next, match.requests) == ("tide?", "wave?", 1)
    assert match.report is not None and match.report.cached_tokens == 12
    line = explain_line(match, "llama.cpp")
    assert line == ("this client sent llama.cpp 1 request that began as this prompt does: its "
                    "first 1 of 2 messages, then 10 of the next one's 15 characters")
    same = ledger.closest([SYS, user("What is a tide?")])
    assert (same.messages, same.chars) == (2, 0)
    assert "all 2 of its messages" in explain_line(same, "llama.cpp")
    never = ledger.closest([user("Hello")])
    assert never.requests == 0 and "sent llama.cpp nothing" in explain_line(never, "llama.cpp")


def test_saved_private_and_read_back(tmp_path) -> None:
    path = ledger_path(tmp_path / "sessions", "http://127.0.0.1:8080/v1/")
    assert path == tmp_path / "sessions" / "sent" / "127.0.0.1_8080_v1.json"
    ledger = Ledger(path, "SGLang", "http://127.0.0.1:8080/v1/")
    ledger.record([SYS, user("hi")], Usage(9, 2, 3), at=7.0)
    ledger.save()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    back = Ledger.open(tmp_path / "sessions", "http://127.0.0.1:8080/v1/", "SGLang")
    assert back.to_json() == ledger.to_json()
    path.write_text("{not json")
    assert Ledger.open(tmp_path / "sessions", "http://127.0.0.1:8080/v1/", "SGLang").roots == []


def test_the_record_is_bounded_by_dropping_the_least_recently_sent(tmp_path, monkeypatch
                                                                   ) -> None:
    monkeypatch.setattr(ledger_module, "MAX_NODES", 4)
    ledger = Ledger(tmp_path / "l.json", "vLLM", "http://h:1")
    for i in range(5):
        ledger.record([SYS, user(f"question {i}")], Usage(9, 2, 0), at=float(i))
    [root] = ledger.roots
    assert [c.content for c in root.children] == ["question 2", "question 3", "question 4"]


def test_the_tree_says_whose_record_it_is_and_tells_siblings_apart(tmp_path) -> None:
    ledger = Ledger(tmp_path / "l.json", "llama.cpp", "http://h:1")
    long = "You answer questions about {}. Examples follow, in the same format each time."
    for topic in ("the sea", "deserts"):
        ledger.record([{"role": "system", "content": long.format(topic)}, user("Q?")],
                      Usage(40, 3, 30), at=1.0)
    text = render(sent_tree(ledger.roots, "llama.cpp", depth=1))
    assert "sent by this client to llama.cpp · 4 messages (its reports, not its cache)" in text
    assert "…out the sea. Examples" in text and "…out deserts. Examples" in text
    assert text.count("2 msgs · sent 1×") == 2  # system + user: one conversation each
    assert "last reply cached 30/40 tok" in text
