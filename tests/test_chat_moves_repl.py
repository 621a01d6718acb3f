"""The conversation moves in the real terminal program, driven through a pty with pexpect on the
tiny model (byte-level: one token per character): /retry is an exact hit, a rewound and
continued turn computes only its new message, a fork shares its history's blocks, and a pinned
system prompt survives eviction pressure that evicts everything else, which the next miss
explains."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

KVCHAT = Path(sys.executable).parent / "kvchat"
SYSTEM = "You are a terse assistant for the kvchat moves test."


def spawn(model_dir: Path, root: Path):
    # 0.25 MiB of K/V: 128 blocks of 4 tokens (512 bytes a token); no disk tier, so evicted
    # blocks are dropped, not spilled
    args = ["chat", "--model", str(model_dir), "--sessions-dir", str(root), "--session", "main",
            "--max-tokens", "8", "--block-size", "4", "--cache-mb", "0.25",
            "--disk-cache-gb", "0"]
    return pexpect.spawn(str(KVCHAT), args, env=dict(os.environ, TERM="dumb"),
                         encoding="utf-8", timeout=60, dimensions=(40, 100))


def send(child, text: str, prompt: str) -> str:
    child.sendline(text)
    child.expect_exact(f"{prompt}> ")
    # the panels wrap lines inside their borders: compare flattened text
    return " ".join(child.before.replace("│", " ").split())


def cached(out: str) -> tuple[int, int]:
    match = re.search(r"cached (\d+) / (\d+) tok", out)
    assert match, out
    return int(match.group(1)), int(match.group(2))


def used_blocks(out: str) -> int:
    match = re.search(r"used (\d+) / 128 blocks", out)
    assert match, out
    return int(match.group(1))


def test_retry_rewind_fork_and_pin_in_a_terminal(tiny_model_dir, tmp_path):
    child = spawn(tiny_model_dir, tmp_path / "sessions")
    try:
        child.expect_exact("main> ")
        send(child, f"/system {SYSTEM}", "main")
        send(child, "first question", "main")
        second = send(child, "second question", "main")
        retried = send(child, "/retry", "main")
        assert "Retried: the prompt was an exact hit, no prefill; at temperature 0 the reply " \
               "is identical." in retried

        # rewound and continued: all but the new message is a hit
        assert "Rewound 1 turn(s); 1 left." in send(child, "/rewind", "main")
        message = "another second question"
        again = send(child, message, "main")
        hit, prompt = cached(again)
        # the hit ends exactly where the new message starts: computed are the message and the
        # template's 13 tokens after it ("<|im_end|>", "\n", "<|im_start|>", "assistant\n")
        # the cache holds the rewound branch from there on: for the reader, just the new message
        assert f"new {prompt - hit} tok: this turn's message, not seen before" in again, again
        assert "why" not in again
        assert prompt - hit == len(message) + 13
        assert cached(second)[0] < hit  # the rewound turn's template text was cached too
        before_fork = used_blocks(again)

        # a fork reads the same blocks: its first turn adds only its own message and reply
        forked = send(child, "/fork side", "side")
        assert "read from the same cached blocks (nothing copied)" in forked
        history = int(re.search(r"([\d,]+) tokens of history", forked).group(1).replace(",", ""))
        side = send(child, "where does the fork go", "side")
        assert cached(side)[0] == history - 1  # the whole history (its last token is recomputed)
        assert used_blocks(side) - before_fork <= (len("where does the fork go") + 40) // 4
        assert history // 4 > 30  # the history alone would have cost more than that
        shared = send(child, "/branches", "side")
        assert "sessions sharing side's history" in shared and "main" in shared

        pinned = send(child, "/pin", "side")
        match = re.search(r"Pinned system prompt: (\d+) tokens in (\d+) blocks", pinned)
        assert match, pinned
        pin_tokens = int(match.group(1))
        assert re.search(rf"pins · [\d,]+ blocks of [\d,]+ allowed .*system prompt\s+"
                         rf"{pin_tokens}", send(child, "/pins", "side"))

        # pressure: one long conversation needs more than the whole pool, twice over
        send(child, "/session filler", "filler")
        for k in range(6):
            filler = send(child, f"{k} " + "a long filler line of text " * 6, "filler")
        assert re.search(r"evictions [1-9]", filler), filler

        # main's history is gone but for the pinned system prompt, and the miss says why
        back = send(child, "/session main", "main")
        assert "main" in back
        cont = send(child, "and then?", "main")
        hit, prompt = cached(cont)
        assert pin_tokens <= hit < pin_tokens + 4, cont  # the pin, up to its block's end
        assert re.search(r"why evicted: tokens \d+-\d+ of \d+ were cached, then evicted by lru",
                         cont), cont
        child.sendline("/stats")
        child.expect(r"integrity (ok|FAILED[^\r\n]*)")
        assert child.match.group(1) == "ok"
        child.expect_exact("main> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
