"""`kvchat verify` on the tiny model: the table, the exit code when a cached run differs from the
cold run, prompt files and their errors."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from kvchat import cli
from kvchat.cli import verify as cli_verify

WIDE = {"COLUMNS": "200"}


@pytest.fixture
def verify(tiny_model_dir):
    def run(*args: str):
        base = ["verify", "--model", str(tiny_model_dir), "--block-size", "4", "--cache-mb", "8"]
        return CliRunner().invoke(cli.app, base + list(args), env=WIDE)

    return run


def rows(output: str) -> list[list[str]]:
    """Table rows: prompt, scenario, hit, equal, first diff, max |Δlogit| (split on 2+ spaces)."""
    found = []
    for line in output.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == 6 and cells[1] in ("prefix hit", "exact repeat", "in a batch",
                                                "plain generate"):
            found.append(cells)
    return found


def test_one_prompt_cached_equals_cold(verify):
    result = verify("Hi, how are you?", "--max-tokens", "6")
    assert result.exit_code == 0, result.output
    table = rows(result.output)
    assert [r[1] for r in table] == ["prefix hit", "exact repeat", "in a batch", "plain generate"]
    prefix, exact, batch, plain = table
    assert prefix[0] == "Hi, how are you?"
    hit, total = map(int, prefix[2].split()[0].split("/"))
    assert 0 < hit < total and prefix[2].endswith("radix")
    assert exact[2] == f"{total}/{total} exact"
    assert batch[2] == f"0/{total} off"  # cold, beside two other sequences
    assert plain[2] == f"0/{total} off"  # kvchat uncached against transformers' generate
    assert [r[3] for r in table] == ["yes"] * 4
    assert [r[4] for r in table] == ["—"] * 4
    assert all(float(r[5]) == 0.0 for r in table)  # bitwise: the forward is batch-invariant
    assert "All 4 runs match their reference run bitwise" in result.output
    assert "tokens came from cache drafts" in result.output  # the repeat drafted its reply


def test_default_prompts_are_ten_and_varied(verify):
    assert len(set(cli_verify.VERIFY_PROMPTS)) == 10
    result = verify("--max-tokens", "2")
    assert result.exit_code == 0, result.output
    assert len(rows(result.output)) == 40
    assert "All 40 runs match" in result.output


def test_a_broken_cache_is_caught_with_exit_code_1(verify, monkeypatch):
    from kvchat.cache.kvcache import PagedKVCache

    gather = PagedKVCache.gather

    def corrupt(self, blocks, n_tokens):
        return [(k + 0.5, v) for k, v in gather(self, blocks, n_tokens)]

    monkeypatch.setattr(PagedKVCache, "gather", corrupt)
    result = verify("Hello there, how are you?", "--max-tokens", "8")
    assert result.exit_code == 1, result.output
    table = rows(result.output)
    assert "NO" in [r[3] for r in table]
    bad = next(r for r in table if r[3] == "NO")
    assert int(bad[4]) >= 0 and float(bad[5]) > 1e-3
    assert re.search(r"[12] of 4 runs differ from their reference run", result.output)


def test_prompt_file_with_messages_ids_and_system(verify, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "Name a colour."}),
        "",
        json.dumps({"id": "chat-2", "system": "Be terse.", "messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Count to three."}]}),
    ]))
    result = verify("--file", str(path), "--max-tokens", "4")
    assert result.exit_code == 0, result.output
    assert [r[0] for r in rows(result.output)] == ["Name a colour."] * 4 + ["chat-2"] * 4


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "ok"}\n{"id": 1}\n',
         'prompts.jsonl line 2: give exactly one of "prompt" or "messages".'),
        ('{"prompt": "ok"}\n{"promt": 1}\n',
         'prompts.jsonl line 2: unknown field "promt" (did you mean "prompt"?)'),
        ("not json\n", "prompts.jsonl line 1: invalid JSON"),
        ("\n\n", "holds no prompts"),
    ],
)
def test_bad_prompt_files_are_clear_errors(verify, tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    result = verify("--file", str(path))
    assert result.exit_code == 2
    assert message in result.output


def test_prompt_and_file_together_are_refused(verify, tmp_path):
    result = verify("hi", "--file", str(tmp_path / "x.jsonl"))
    assert result.exit_code == 2
    assert "Give a prompt or --file, not both." in result.output


def test_each_line_of_a_file_is_checked_on_its_own(verify, tmp_path):
    # both lines share the template's default system prompt; with one cache across lines the
    # second's "prefix hit" would reach into the first's blocks, past its own half
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "Name a colour."}) + "\n"
                    + json.dumps({"prompt": "Name a colour, please."}) + "\n")
    result = verify("--file", str(path), "--max-tokens", "3")
    assert result.exit_code == 0, result.output
    prefix_hits = [r[2] for r in rows(result.output) if r[1] == "prefix hit"]
    for cell in prefix_hits:
        hit, total = map(int, cell.split()[0].split("/"))
        assert hit == total // 2  # the half verify cached, nothing more


def test_a_difference_rounding_would_explain_still_fails(verify, monkeypatch):
    """The forward is batch-invariant here, so verify allows no tolerance: a cached K/V off by
    one part in 10^7 (inside float32's old 1e-5 allowance) fails it."""
    from kvchat.cache.kvcache import PagedKVCache

    gather = PagedKVCache.gather

    def nudge(self, blocks, n_tokens):
        return [(k * (1 + 1e-7), v) for k, v in gather(self, blocks, n_tokens)]

    monkeypatch.setattr(PagedKVCache, "gather", nudge)
    result = verify("Hello there, how are you?", "--max-tokens", "4")
    assert result.exit_code == 1, result.output
    bad = [r for r in rows(result.output) if r[3] == "NO"]
    assert bad and all(float(r[5]) < 1e-3 for r in bad)


def test_fidelity_is_reported_beside_the_checks_and_never_fails_them(verify):
    result = verify("Hi, how are you?", "--max-tokens", "4", "--fidelity")
    assert result.exit_code == 0, result.output
    assert re.search(r"Fidelity: [01] of 1 texts at float32 equal the float32 model's own "
                     r"generate", " ".join(result.output.split())), result.output
    assert len(rows(result.output)) == 4  # the cache checks are unchanged
