"""The README and docs/ are true: the quick start says how to reach `kvchat` after `make`, every
`--option` a command line in them shows is one that command takes, the README stays a front
door (300 lines at most) that links every page of docs/, and every relative link and anchor
leads somewhere."""

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
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "sessions" / "README.md",
         *sorted((ROOT / "docs").glob("*.md"))]
DOCS = "\n".join(page.read_text() for page in PAGES)
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


def without_code(text: str, inline: bool = True) -> str:
    """Markdown outside fenced code blocks (a `# comment` in a shell block is not a heading)
    and, with `inline`, outside inline code (a `[x](y)` in code is not a link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text) if inline else text


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces
    become hyphens."""
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", without_code(page.read_text(), inline=False),
                              re.M):
        found.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return found


def test_github_anchors_are_computed_as_github_does():
    page = ROOT / "docs" / "inspect.md"
    assert "kvchat-inspect---explain-why-would-this-prompt-miss" in anchors(page)


def test_the_readme_is_a_front_door():
    lines = README.count("\n")
    assert lines <= 300, f"README.md has {lines} lines: the reference belongs in docs/"


def test_every_docs_page_is_linked_from_the_readme():
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]*)?\)", README))
    pages = {f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set(), f"not linked from README.md: {sorted(pages - linked)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_exists(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", without_code(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_makefile_and_pyproject_pin_the_same_torch():
    makefile = re.search(r"^TORCH \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    pyproject = re.search(r'^\s*"(torch[^"]*)",', (ROOT / "pyproject.toml").read_text(), re.M)
    assert makefile and pyproject and makefile.group(1) == pyproject.group(1)


def test_what_the_docs_commands_write_at_the_root_is_ignored_by_git():
    written = set(re.findall(r"(?:-o|>) ([\w.-]+\.jsonl)\b", DOCS))
    assert written, "no output file found in the docs' commands"
    ignored = subprocess.run(["git", "check-ignore", *sorted(written)], cwd=ROOT,
                             capture_output=True, text=True).stdout.split()
    assert set(ignored) == written, f"not in .gitignore: {sorted(written - set(ignored))}"
