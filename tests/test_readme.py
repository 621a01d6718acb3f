"""The README's commands are real: the quick start says how to reach `kvchat` after `make`,
and every `--option` a README command line shows is one that command takes."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvchat.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = README + (ROOT / "sessions" / "README.md").read_text()
BENCH = ("ttft", "overhead", "cache", "batch", "decode", "multiturn", "policies", "tiers",
         "fleet")


COMMANDS = set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def command_lines() -> list[str]:
    """`kvchat ...` in inline code, and `kvchat <command> ...` at the start of code-block
    lines (a line of printed output that starts with "kvchat", a bench verdict, is not one)."""
    found = re.findall(r"`(kvchat [^`]+)`", DOCS)
    for block in re.findall(r"```\w*\n(.*?)```", DOCS, re.S):
        for line in block.splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("kvchat ") and line.split()[1] in COMMANDS:
                found.append(line.split("  #")[0].rstrip(" \\"))
    return found


def options_by_command() -> dict[tuple[str, ...], set[str]]:
    out: dict[tuple[str, ...], set[str]] = {}
    for line in command_lines():
        words = shlex.split(line.replace("\\|", "|"), posix=True)[1:]
        command = tuple(words[:2]) if words[0] == "bench" and words[1:2] and \
            words[1] in BENCH else tuple(words[:1])
        options = {w.split("=")[0].strip("[]") for w in words if w.lstrip("[").startswith("--")}
        out.setdefault(command, set()).update(options)
    return out


def test_the_quick_start_says_how_to_run_kvchat_after_make():
    quick = README.split("## Quick start")[1].split("\n## ")[0]
    assert "source .venv/bin/activate" in quick and ".venv/bin/kvchat" in quick
    dry = subprocess.run(["make", "-n", "chat"], cwd=ROOT, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert "source .venv/bin/activate" in dry.stdout  # make chat prints it as well


@pytest.mark.parametrize("command", sorted(options_by_command()), ids=" ".join)
def test_every_option_the_readme_shows_exists(command):
    shown = options_by_command()[command]
    help_text = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"}).output
    assert "Usage:" in help_text, help_text
    missing = sorted(o for o in shown if not re.search(rf"{re.escape(o)}\b", help_text))
    assert not missing, f"kvchat {' '.join(command)} has no {missing}"
