"""A new user's first hour, scripted through the real programs on the tiny model, asserting on
what the screen says: a first chat turn in a fresh sessions dir, /retry, /rewind, /fork, /pin,
/exit; the session resumed; a batch of the example files; inspect; serve --detach, a chat
attached to it, and stop."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

KVCHAT = Path(sys.executable).parent / "kvchat"
EXAMPLES = Path(__file__).resolve().parent.parent / "sessions" / "examples"
TIMEOUT_S = 120


def model_args(model: Path) -> list[str]:
    return ["--model", str(model), "--block-size", "4", "--cache-mb", "8"]


def spawn_chat(root: Path, *args: str):
    return pexpect.spawn(str(KVCHAT), ["chat", "--max-tokens", "6", *args,
                                       "--sessions-dir", str(root)],
                         env=dict(os.environ, TERM="dumb"), encoding="utf-8",
                         timeout=TIMEOUT_S, dimensions=(40, 100))


def screen(child, line: str, prompt: str) -> str:
    """Send a line; what the screen showed until the next prompt, flattened (panels wrap)."""
    child.sendline(line)
    child.expect_exact(f"{prompt}> ")
    return " ".join(child.before.replace("│", " ").split())


def kvchat(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(KVCHAT), *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=dict(os.environ, COLUMNS="120"))
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    return done


def flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def test_the_first_hour(tiny_model_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "sessions"
    # a fresh sessions dir: the first chat names its session and says nothing is cached yet
    child = spawn_chat(root, *model_args(tiny_model_dir))
    try:
        child.expect_exact("chat-1> ")
        banner = flat(child.before)
        assert "session chat-1: new" in banner and "snapshot none yet" in banner
        first = screen(child, "Hello there, what is a cache?", "chat-1")
        assert "turn 1 · cache" in first and "cached 0 /" in first
        retried = screen(child, "/retry", "chat-1")
        assert "Retried: the prompt was an exact hit, no prefill; at temperature 0 the reply " \
               "is identical." in retried
        assert "Rewound 1 turn(s); 0 left." in screen(child, "/rewind", "chat-1")
        again = screen(child, "And what is a KV cache?", "chat-1")
        assert "turn 1 · cache" in again and re.search(r"cached [1-9]\d* / \d+ tok", again)
        forked = screen(child, "/fork side", "side")
        assert "Forked chat-1 into side" in forked and "session side: resumed, 1 turn" in forked
        side = screen(child, "Tell me more.", "side")
        assert "new " in side and "tok: this turn's message, not seen before" in side
        assert "why cold" not in side
        pinned = screen(child, "/pin", "side")
        assert re.search(r"Pinned system prompt: \d+ tokens in \d+ blocks", pinned), pinned
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert sorted(p.name for p in root.glob("*.json")) == ["chat-1.json", "side.json"]

    # resumed: the session's turn, and the cache restored from the snapshot
    child = spawn_chat(root, "--session", "chat-1", *model_args(tiny_model_dir))
    try:
        child.expect_exact("chat-1> ")
        banner = flat(child.before)
        assert "session chat-1: resumed, 1 turn" in banner
        assert re.search(r"snapshot restored [\d,]+ cached tokens", banner), banner
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()

    # a batch of the example files, one after another on the same cache
    for example in ("shared_system", "few_shot", "multi_turn"):
        out = tmp_path / f"{example}.out.jsonl"
        done = kvchat("batch", str(EXAMPLES / f"{example}.jsonl"), "-o", str(out),
                      "--max-tokens", "8", "--batch-size", "4", "--sessions-dir", str(root),
                      *model_args(tiny_model_dir))
        assert done.returncode == 0, done.stderr
        summary = flat(done.stdout)
        assert "requests 6 finished, 0 failed" in summary
        asked = json.loads((EXAMPLES / f"{example}.jsonl").read_text().splitlines()[0])
        # the lines' own max_tokens beat --max-tokens 8, and the summary says so
        assert f"6 line(s) set their own, which wins: {asked['max_tokens']}" in summary
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert len(rows) == 6 and all(r["finish_reason"] in ("stop", "length") for r in rows)
        if example != "multi_turn":  # rows after the first share the file's prefix
            assert {r["miss_label"] for r in rows[1:]} == {"shared prefix"}
            assert {r["miss_reason"] for r in rows[1:]} == {"diverged"}

    # inspect, without the model: the tree, the exact index, both tiers
    shown = kvchat("inspect", "--sessions-dir", str(root))
    assert shown.returncode == 0, shown.stderr
    text = flat(shown.stdout)
    assert "radix tree" in text and re.search(r"exact index · [1-9]\d* entries", text)
    assert re.search(r"disk tier [\d,]+ blocks", text)

    # a resident server; a chat attaches to it; stop saves and ends it
    started = kvchat("serve", "--detach", "--port", "0", "--device", "cpu", "--sessions-dir",
                     str(root), *model_args(tiny_model_dir))
    assert started.returncode == 0, started.stderr
    said = flat(started.stdout)
    assert "kvchat serve is running at http://127.0.0.1:" in said
    assert f"`kvchat token --sessions-dir {root}` prints it" in said
    try:
        token = kvchat("token", "--sessions-dir", str(root)).stdout.strip()
        assert token == json.loads((root / ".lock").read_text())["token"]
        child = spawn_chat(root, "--session", "chat-1")
        try:
            child.expect_exact("chat-1> ")
            assert re.search(r"server\s+http://127\.0\.0\.1:\d+", child.before)
            attached = screen(child, "One more question?", "chat-1")
            assert "turn 2 · cache" in attached and re.search(r"cached [1-9]", attached)
            child.sendline("/exit")
            child.expect(pexpect.EOF)
        finally:
            child.close()
    finally:
        stopped = kvchat("stop", "--sessions-dir", str(root))
    assert stopped.returncode == 0, stopped.stderr
    assert "Stopped kvchat serve" in stopped.stdout and "the cache snapshot is saved" in \
        flat(stopped.stdout)
    assert len(json.loads((root / "chat-1.json").read_text())["turns"]) == 2
