"""The chat loop in-process on the tiny model, fed by a scripted reader: slash commands, saving,
and Ctrl-C during a reply (the signal handler and a KeyboardInterrupt raised mid-forward)."""

from __future__ import annotations

import io
import json
import re
import signal
from collections.abc import Callable

import pytest
from conftest import make_runtime
from rich.console import Console

from kvchat.chat.repl import (
    Chat,
    Command,
    message_text,
    next_session_name,
    parse_command,
    unknown_command_hint,
)
from kvchat.config import SamplingParams
from kvchat.runtime import Runtime
from kvchat.sessions import Session
from kvchat.snapshots import read_snapshot_meta

Line = str | BaseException | Callable[[], str]


class Script:
    """A LineReader that replays lines; an exception item is raised, a callable is called."""

    def __init__(self, *lines: Line) -> None:
        self.lines = list(lines)
        self.prompts: list[str] = []

    def read(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if not self.lines:
            raise EOFError
        item = self.lines.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item() if callable(item) else item


def run_chat(rt: Runtime, *lines: Line, name: str = "demo", max_tokens: int = 6,
             panels: str = "full") -> tuple[str, Chat]:
    console = Console(file=io.StringIO(), width=80, color_system=None, force_terminal=False)
    chat = Chat(rt, rt.store.load(name), SamplingParams(max_new_tokens=max_tokens), console,
                Script(*lines), panels)
    chat.run()
    return console.file.getvalue(), chat


def cached_numbers(output: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(r"cached (\d+) / (\d+) tok", output)]


# ---- parsing -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "command"),
    [
        ("/help", Command("help", "")),
        ("  /Session  work-2 ", Command("session", "work-2")),
        ("/system Be brief and kind.", Command("system", "Be brief and kind.")),
        ("/quit", Command("exit", "")),
        ("/?", Command("help", "")),
        ("/", Command("", "")),
        ("hello /tree", None),
        ("//tree is a word", None),
    ],
)
def test_parse_command(line, command):
    assert parse_command(line) == command


def test_message_text_unescapes_a_leading_double_slash():
    assert message_text("//etc/hosts please ") == "/etc/hosts please"
    assert message_text(" hi ") == "hi"


def test_unknown_command_hint_suggests_the_closest():
    assert unknown_command_hint("sesions") == (
        "Unknown command /sesions. Did you mean /sessions? Type /help for the list."
    )
    assert unknown_command_hint("zzz") == "Unknown command /zzz. Type /help for the list."


def test_next_session_name_fills_the_first_gap():
    assert next_session_name([]) == "chat-1"
    assert next_session_name(["chat-1", "chat-3", "demo"]) == "chat-2"


# ---- the loop ------------------------------------------------------------------------------


def test_turns_hit_the_history_and_commands_answer(tiny_model, tiny_tokenizer, tmp_path):
    rt = make_runtime(tiny_model, tiny_tokenizer, tmp_path)
    out, chat = run_chat(
        rt,
        "hello there",
        "and again",
        "/tree",
        "/stats",
        "/sessin",
        "/session ../evil",
        "/panels loud",
        "/panels compact",
        "third",
        "/sessions",
        KeyboardInterrupt(),  # Ctrl-C at the prompt: the loop goes on
        "/exit",
        "never read",
    )
    turns = chat.session.turns
    assert len(turns) == 3
    assert [t.hit_tokens for t in turns][0] == 0
    # turn 2's prompt starts with turn 1's prompt + reply, all but the last token cached
    assert turns[1].hit_tokens == turns[0].prompt_tokens + turns[0].completion_tokens - 1
    assert cached_numbers(out)[:2] == [(0, turns[0].prompt_tokens),
                                       (turns[1].hit_tokens, turns[1].prompt_tokens)]
    assert "integrity ok" in out
    assert "Unknown command /sessin. Did you mean /session? Type /help for the list." in out
    assert "Invalid session name '../evil'" in out
    assert "Panels are full. Usage: /panels off|compact|full" in out
    assert re.search(r"turn 3 · \d+/\d+ cached \d+\.\d% radix", out)  # compact panels
    assert re.search(r"\*\s+demo\s+3", out)  # /sessions marks the current one
    assert chat.reader.lines == ["never read"]
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert len(saved["turns"]) == 3 and saved["tokens"] == chat.session.tokens
    assert read_snapshot_meta(tmp_path) is not None  # written on the way out
    rt.cache.check_integrity()


def test_sessions_switch_new_reset_system_clear(tiny_model, tiny_tokenizer, tmp_path):
    rt = make_runtime(tiny_model, tiny_tokenizer, tmp_path)
    out, chat = run_chat(
        rt, "hi", "/new", "/session demo", "/system Answer in French.", "/system",
        "/reset", "/clear-cache", "/session other", "/session other",
    )
    assert "session chat-1: new" in out
    assert "session demo: resumed, 1 turn" in out
    assert "System prompt set." in out
    assert "System prompt: Answer in French." in out
    assert "Session demo starts over; the shared cache is kept." in out
    assert re.search(r"Cleared the cache: [1-9]\d* blocks freed\.", out)
    assert "Already in session other." in out
    assert chat.session.name == "other"
    demo = rt.store.load("demo")
    assert demo.turns == [] and demo.system == "Answer in French."
    assert rt.cache.stats().tree_tokens == 0
    # sessions nothing happened in leave no file behind
    assert rt.store.names() == ["demo"]
    rt.cache.check_integrity()


def test_an_empty_new_session_is_not_saved_and_its_name_stays_free(tiny_model, tiny_tokenizer,
                                                                   tmp_path):
    rt = make_runtime(tiny_model, tiny_tokenizer, tmp_path)
    out, chat = run_chat(rt, "/new", "/new", "/exit", name="chat-1")
    assert "session chat-2: new\nsession chat-1: new" in out  # chat-1 was never saved
    assert rt.store.names() == []
    out, chat = run_chat(rt, "hello", name="chat-1")
    assert rt.store.names() == ["chat-1"]


def test_quitting_says_what_was_saved_and_where(tiny_model, tiny_tokenizer, tmp_path):
    rt = make_runtime(tiny_model, tiny_tokenizer, tmp_path)
    out, chat = run_chat(rt, "hello", "again", "/exit")
    tokens = chat.backend.stats().tree_tokens
    assert tokens > 0 and len(rt.store.load("demo").turns) == 2
    said = " ".join(out.split())
    assert said.endswith(f"Saved session demo (2 turns) and the cache snapshot ({tokens:,} "
                         f"tokens) in {rt.options.sessions_dir}.")
    out, chat = run_chat(rt, name="chat-9")  # Ctrl-D at once: nothing for the session
    assert "Saved nothing for session chat-9 (no turns) and the cache snapshot" in out


def test_snapshot_every_three_turns_and_on_an_exception(tiny_model, tiny_tokenizer, tmp_path):
    rt = make_runtime(tiny_model, tiny_tokenizer, tmp_path)

    def snapshot_state() -> str:
        info = read_snapshot_meta(tmp_path)
        return "none" if info is None else str(info.meta["snapshot_id"])

    seen: list[str] = []

    def look() -> str:
        seen.append(snapshot_state())
        return "next"

    with pytest.raises(RuntimeError, match="reader broke"):
        run_chat(rt, "one", "two", look, look, "four", RuntimeError("reader broke"))
    # none after two turns, one after the third; the exception still saved everything
    assert seen[0] == "none" and seen[1] != "none"
    assert snapshot_state() not in ("none", seen[1])
    assert len(rt.store.load("demo").turns) == 5


def test_first_ctrl_c_stops_the_reply_and_the_loop_goes_on(
    tiny_model, tiny_tokenizer, tmp_path, monkeypatch
):
    rt = make_runtime(tiny_model, tiny_tokenizer, tmp_path)
    runner = rt.engine.runner
    forward = runner.forward
    calls = {"n": 0}

    def press_ctrl_c_on_third_decode(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # one prefill, then decode steps
            signal.raise_signal(signal.SIGINT)
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "forward", press_ctrl_c_on_third_decode)
    before = signal.getsignal(signal.SIGINT)
    out, chat = run_chat(rt, "tell me a long story", "and then?", max_tokens=200)
    assert signal.getsignal(signal.SIGINT) is before  # the REPL's handler was removed
    first, second = chat.session.turns
    assert first.finish_reason == "interrupted" and first.completion_tokens == 4
    assert "[stopped]" in out and "interrupted" in out
    assert second.hit_tokens == first.prompt_tokens + first.completion_tokens - 1
    rt.cache.check_integrity()


def test_keyboard_interrupt_inside_a_forward_keeps_cache_and_loop(
    tiny_model, tiny_tokenizer, tmp_path, monkeypatch
):
    """A second Ctrl-C raises KeyboardInterrupt wherever the reply is; nothing leaks."""
    rt = make_runtime(tiny_model, tiny_tokenizer, tmp_path)
    runner = rt.engine.runner
    forward = runner.forward
    calls = {"n": 0}

    def interrupted_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "forward", interrupted_forward)
    out, chat = run_chat(rt, "story please", "more", max_tokens=50)
    first, second = chat.session.turns
    assert first.finish_reason == "interrupted"
    assert second.finish_reason in ("stop", "length") and second.hit_tokens > first.prompt_tokens
    rt.cache.check_integrity()
    assert all(b.ref_count == 0 for b in rt.cache.tree.all_blocks())


def test_system_option_applies_to_the_session(tiny_model, tiny_tokenizer, tmp_path):
    rt = make_runtime(tiny_model, tiny_tokenizer, tmp_path)
    rt.store.save(Session("demo", system="Old."))
    console = Console(file=io.StringIO(), width=80, color_system=None)
    session = rt.store.load("demo")
    session.system = "New."
    Chat(rt, session, SamplingParams(max_new_tokens=3), console, Script("hi")).run()
    assert rt.store.load("demo").system == "New."
    assert "system   New." in console.file.getvalue()


def test_a_prompt_beyond_the_context_says_how_to_go_on(tiny_model, tiny_tokenizer, tmp_path):
    rt = make_runtime(tiny_model, tiny_tokenizer, tmp_path)
    out, chat = run_chat(rt, "x" * 3000, "/stats")
    assert "the model's context is 2048 tokens. Start over with /reset or /new." in " ".join(
        out.split())
    assert chat.session.turns == [] and "integrity ok" in out


def test_banner_says_why_a_snapshot_was_set_aside(tiny_model, tiny_tokenizer, tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "index.json").write_text("{broken")
    rt = make_runtime(tiny_model, tiny_tokenizer, tmp_path)
    out, _ = run_chat(rt)
    banner = " ".join(out.replace("│", " ").split())
    assert "snapshot Cache snapshot unreadable" in banner and "set aside in" in banner
    assert "snapshot none yet" not in banner


def test_a_failed_save_is_reported_and_the_chat_goes_on(tiny_model, tiny_tokenizer, tmp_path,
                                                         monkeypatch):
    from kvchat.sessions import SessionWriteError

    rt = make_runtime(tiny_model, tiny_tokenizer, tmp_path)
    calls = {"n": 0}

    def full_disk() -> None:
        calls["n"] += 1
        raise SessionWriteError("Could not write the cache snapshot: the disk is full.")

    monkeypatch.setattr(rt, "save", full_disk)
    out, chat = run_chat(rt, "one", "two", "three", "four", "/save")
    assert len(chat.session.turns) == 4  # every line after the failed save still ran
    flat = " ".join(out.split())
    assert "the disk is full. The chat goes on" in flat
    assert calls["n"] >= 3  # after turn 3, after turn 4 (retried), /save, and on exit
    assert "Saved session" not in flat


def test_retry_rewind_fork_and_branches_reuse_the_tree(tiny_model, tiny_tokenizer, tmp_path):
    rt = make_runtime(tiny_model, tiny_tokenizer, tmp_path)
    out, chat = run_chat(rt, "first question", "second question", "/retry", name="main",
                         panels="off")
    flat = " ".join(out.split())
    main = chat.session
    assert len(main.turns) == 2
    # the retried prompt was the same tokens: an exact hit, and greedy gives the same reply
    assert main.turns[-1].source == "exact"
    assert "Retried: the prompt was an exact hit, no prefill; at temperature 0 the reply is " \
           "identical." in flat

    history = list(main.tokens)
    out, chat = run_chat(rt, "/rewind", "a different second question", name="main", panels="off")
    rewound = chat.session
    assert len(rewound.turns) == 2 and "Rewound 1 turn(s); 1 left." in " ".join(out.split())
    first = rewound.turns[0]
    kept = first.prompt_tokens + first.completion_tokens  # turn 1's prompt and reply
    assert rewound.tokens[:kept] == history[:kept]
    assert rewound.turns[1].start_tokens == kept
    # all of turn 1 and the template around the new message were cached (by the turn that
    # was rewound): only the new message itself was computed
    old_prompt = history[: main.turns[1].prompt_tokens]
    new_prompt = rewound.tokens[: rewound.turns[1].prompt_tokens]
    shared = next(i for i, (a, b) in enumerate(zip(old_prompt, new_prompt, strict=False)) if a != b)
    assert shared > kept and rewound.turns[1].hit_tokens == shared

    used = rt.cache.stats().pool.used_blocks
    out, chat = run_chat(rt, "/fork side", "/branches", name="main", panels="off")
    flat = " ".join(out.split())
    assert chat.session.name == "side" and "read from the same cached blocks" in flat
    assert rt.cache.stats().pool.used_blocks == used  # forking copied nothing
    assert chat.session.tokens == rewound.tokens
    # /branches lists the session it came from, sharing all of its history
    assert re.search(rf"main[\s│]+{len(rewound.tokens):,}", out)
    out, chat = run_chat(rt, "where the fork goes", name="side", panels="off")
    side = chat.session
    assert side.turns[-1].hit_tokens == len(rewound.tokens) - 1  # the shared history hit
    out, chat = run_chat(rt, "/branches", name="main", panels="off")
    assert "side" in out and "sharing main's history" in " ".join(out.split())
    rt.cache.check_integrity()


def test_a_pinned_system_prompt_survives_pressure_and_the_panel_says_why(
        tiny_model, tiny_tokenizer, tmp_path):
    rt = make_runtime(tiny_model, tiny_tokenizer, tmp_path, restore=False, num_blocks=60)
    out, chat = run_chat(rt, "/system You are a terse assistant for kvchat tests.",
                         "hello there", "/pin", "/pins", name="pinned")
    flat = " ".join(out.split())
    assert "Pinned system prompt:" in flat and "pins · " in flat
    pin = next(iter(rt.cache.pins))
    assert "terse assistant" in rt.engine.codec.decode(list(pin.tokens))
    # other conversations fill the pool many times over: everything unpinned is evicted
    for k in range(6):
        run_chat(rt, "word " * 40 + str(k), name=f"filler-{k}", panels="off")
    assert rt.cache.stats().eviction_count > 0
    rt.cache.check_integrity()
    assert rt.cache.peek(list(pin.tokens)) == len(pin.tokens)
    # a new conversation with that system prompt hits it, and the panel says where it ended
    out, chat = run_chat(rt, "/system You are a terse assistant for kvchat tests.",
                         "a new question", name="again")
    assert chat.session.turns[-1].hit_tokens >= len(pin.tokens)
    # it shares the system prompt, then leaves what the other conversation said next
    assert f"shared prefix {chat.session.turns[-1].hit_tokens} tok, as earlier conversations " \
           "began; then new" in " ".join(out.split())
    out, chat = run_chat(rt, "/unpin", name="pinned", panels="off")
    assert "Unpinned system prompt" in " ".join(out.split()) and len(rt.cache.pins) == 0
    rt.cache.check_integrity()


def test_pin_refuses_past_max_pinned(tiny_model, tiny_tokenizer, tmp_path):
    # max_pinned: 2 blocks, less than any prompt
    rt = make_runtime(tiny_model, tiny_tokenizer, tmp_path, restore=False, num_blocks=200,
                      max_pinned=0.01)
    out, _ = run_chat(rt, "hello there", "/pin all", name="big", panels="off")
    flat = " ".join(out.split())
    assert "Not pinned:" in flat and "--max-pinned" in flat and len(rt.cache.pins) == 0


def test_retry_after_a_stopped_reply_says_it_is_the_same_reply(
    tiny_model, tiny_tokenizer, tmp_path, monkeypatch
):
    rt = make_runtime(tiny_model, tiny_tokenizer, tmp_path)
    runner = rt.engine.runner
    forward = runner.forward
    calls = {"n": 0}

    def ctrl_c_in_the_first_reply(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # one prefill, then decode steps
            signal.raise_signal(signal.SIGINT)
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "forward", ctrl_c_in_the_first_reply)
    out, chat = run_chat(rt, "tell me a long story", "/retry", max_tokens=12, panels="off")
    turn = chat.session.turns[-1]
    assert turn.finish_reason != "interrupted" and turn.completion_tokens > 4
    flat = " ".join(out.split())
    assert "at temperature 0 the reply is the same as the stopped one, this time not " \
           "stopped." in flat
    assert "different" not in flat


def test_compare_replies_tells_a_cut_reply_from_a_different_one():
    from kvchat.chat.moves import compare_replies

    assert compare_replies([1, 2], "stop", [1, 2], "stop") == "identical"
    cut = compare_replies([1, 2, 3], "stop", [1, 2], "interrupted")
    assert cut.startswith("the same as before")
    assert compare_replies([1, 2], "interrupted", [1, 3], "length") == "different"
    assert compare_replies([1, 2], "stop", [1, 2, 3], "length") == "different"


def test_an_ordinary_turn_reads_as_new_not_as_a_cold_miss(tiny_model, tiny_tokenizer, tmp_path):
    rt = make_runtime(tiny_model, tiny_tokenizer, tmp_path)
    out, chat = run_chat(rt, "first question", "second question")
    first, second = chat.session.turns
    flat = " ".join(out.split("turn 2 · cache")[1].replace("│", " ").split())
    # the whole history was cached; what was computed is the new message and its template
    assert f"new {second.prompt_tokens - second.hit_tokens} tok: this turn's message, not " \
           "seen before" in flat
    assert "why" not in flat
    assert "why cold: none of the" in out.split("turn 2 · cache")[0]  # the first was cold
