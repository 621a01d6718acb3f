"""The real terminal program, driven through a pty with pexpect on the tiny model: two turns with
panels, /tree, the lock against a second process, /exit; then a second run that resumes the
session from the snapshot, survives Ctrl-C during replies, and leaves a consistent cache."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

KVCHAT = Path(sys.executable).parent / "kvchat"
PROMPT = "demo> "
# Greedy on the tiny model, after this test's first two turns, this message gets a reply that
# runs to the context limit (1,854 tokens), so a Ctrl-C sent a moment after it starts always lands
# mid-reply.
LONG_REPLY = "Tell me a story."


def spawn(model_dir: Path, root: Path, max_tokens: int):
    env = dict(os.environ, TERM="dumb", HF_HUB_OFFLINE="1")
    args = ["chat", "--model", str(model_dir), "--sessions-dir", str(root), "--session", "demo",
            "--max-tokens", str(max_tokens), "--block-size", "4", "--cache-mb", "8"]
    child = pexpect.spawn(str(KVCHAT), args, env=env, encoding="utf-8", timeout=60,
                          dimensions=(24, 80))
    return child


def turn(child, text: str) -> str:
    child.sendline(text)
    child.expect_exact(PROMPT)
    return child.before


def cached(output: str) -> tuple[int, int]:
    match = re.search(r"cached (\d+) / (\d+) tok", output)
    assert match, output
    return int(match.group(1)), int(match.group(2))


def interrupted_turn(child, text: str) -> str:
    child.sendline(text)
    child.expect_exact("assistant> ")
    child.expect(r"\S")  # the reply has started streaming
    time.sleep(0.2)
    child.sendintr()
    child.expect_exact(PROMPT)
    return child.before


def test_chat_in_a_terminal_resumes_from_the_snapshot(tiny_model_dir, tmp_path):
    root = tmp_path / "sessions"
    child = spawn(tiny_model_dir, root, max_tokens=8)
    try:
        child.expect(r"session\s+demo: new")
        child.expect_exact(PROMPT)
        first = turn(child, "hello there")
        assert "turn 1 · cache" in first and "block pool · lru" in first
        assert "radix tree · 1 node ·" in first
        assert cached(first)[0] == 0
        second = turn(child, "how are you?")
        assert "turn 2 · cache" in second
        hit, prompt2 = cached(second)
        assert 0 < hit < prompt2

        # a second kvchat on the same folder is told who holds it
        other = subprocess.run(
            [str(KVCHAT), "chat", "--sessions-dir", str(root)], capture_output=True, text=True,
            env=dict(os.environ, COLUMNS="200"), timeout=60,
        )
        assert other.returncode == 2
        assert f"is in use by pid {child.pid} (kvchat chat, since" in other.stderr

        tree = turn(child, "/tree")
        assert re.search(r"radix tree · \d+ nodes? · \d+ tok", tree)
        assert re.search(r'\d+ tok · \d+ blk · ref 0 "<\|im_start\|….*" demo', tree)
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0

    child = spawn(tiny_model_dir, root, max_tokens=4000)
    try:
        child.expect(r"snapshot restored ([\d,]+) cached tokens")
        assert int(child.match.group(1).replace(",", "")) > prompt2
        child.expect(r"session\s+demo: resumed, 2 turns")
        child.expect_exact(PROMPT)
        third = interrupted_turn(child, LONG_REPLY)
        assert "[stopped]" in third and "interrupted" in third, third[-1500:]
        # the whole history from disk: turn 2's prompt and reply (8 tokens) but its last token,
        # whose K/V no forward pass computed
        assert cached(third)[0] == prompt2 + 8 - 1
        turn(child, "/panels compact")
        # long after every history tried, but where turn 3 stopped varies with timing: this
        # reply may end on its own before the Ctrl-C, which then only clears the prompt
        fourth = interrupted_turn(child, "And then?")
        assert re.search(r"turn 4 · \d+/\d+ cached", fourth)
        # if that reply ended before the Ctrl-C, the Ctrl-C drew one more prompt: wait for the
        # /stats output itself rather than for the next prompt
        child.sendline("/stats")
        child.expect(r"integrity (ok|FAILED[^\r\n]*)")
        assert child.match.group(1) == "ok", child.match.group(1)
        child.expect_exact(PROMPT)
        # prompt-toolkit switches the terminal to raw mode just after printing the prompt; a
        # Ctrl-D sent before that is taken by the tty as end-of-file, not read as a key
        time.sleep(0.5)
        child.sendcontrol("d")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0

    from kvchat.config import CacheConfig
    from kvchat.runtime import Runtime, RuntimeOptions

    rt = Runtime.open(RuntimeOptions(model=str(tiny_model_dir), cache=CacheConfig(4, cache_mb=8),
                                     sessions_dir=root))
    assert rt.notice is None and rt.restored_tokens > 0
    rt.cache.check_integrity()
    turns = rt.store.load("demo").turns
    assert [t.finish_reason for t in turns][:3] == ["length", "length", "interrupted"]
    assert len(turns) == 4
