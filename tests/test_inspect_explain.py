"""`kvchat inspect --explain`: why a prompt would miss, answered from a real snapshot (the tiny
model ran the turns, the Runtime saved them) without torch, and the same answer as the live
cache's `explain` for the same prompt ids: cold, evicted (dropped by `clear`), diverged, hit."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvchat import cli
from kvchat.config import CacheConfig, SamplingParams
from kvchat.engine.scheduler import common_prefix
from kvchat.inspect.explain import PromptSpec, SnapshotTokenizer, prompt_ids
from kvchat.runtime import Runtime, RuntimeOptions
from kvchat.snapshots import read_snapshot_meta
from kvchat.turns import prepare_turn

WIDE = {"COLUMNS": "200"}
SYSTEM = "You answer questions about the cache in one short sentence."
EVICTED = "Alpha: list every eviction policy kvchat ships."
KEPT = "The quick brown fox jumps over the lazy dog near the river bank."
CHANGED = KEPT.replace("dog", "cat")  # one word in the middle


@dataclass
class Saved:
    root: Path
    runtime: Runtime
    ids: dict[str, list[int]]  # each turn's prompt ids, as the engine ran them

    def live(self, ids: list[int]) -> dict[str, Any]:
        return dict(self.runtime.cache.explain(ids).to_json())

    def encode(self, text: str, system: str | None = SYSTEM) -> list[int]:
        turn = prepare_turn(self.runtime.engine.codec, [{"role": "user", "content": text}],
                            SamplingParams(), system=system)
        return turn.prompt_ids


@pytest.fixture(scope="module")
def saved(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Turn EVICTED ran, then `clear` dropped every block (tombstones, policy "clear"; with a
    disk tier, eviction spills instead, so only clear truly drops), then turn KEPT ran with
    the same system prompt, and the Runtime saved the snapshot."""
    root = tmp_path_factory.mktemp("sessions")
    rt = Runtime.open(RuntimeOptions(model=str(tiny_model_dir), device="cpu",
                                     cache=CacheConfig(4, num_blocks=128), sessions_dir=root))
    ids = {}
    for text in (EVICTED, KEPT):
        turn = prepare_turn(rt.engine.codec, [{"role": "user", "content": text}],
                            SamplingParams(max_new_tokens=4), system=SYSTEM)
        rt.engine.generate(turn.request())
        rt.cache.check_integrity()
        ids[text] = turn.prompt_ids
        if text == EVICTED:
            assert rt.cache.clear() > 0
            rt.cache.check_integrity()
    assert rt.save() is not None
    yield Saved(root, rt, ids)
    rt.close()


def explain(root: Path, *args: str) -> dict[str, Any]:
    result = CliRunner().invoke(cli.app, ["inspect", "--sessions-dir", str(root), "--json",
                                          *args], env=WIDE)
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.output))


def without_detail(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != "detail"}


def test_the_snapshot_records_the_template_and_special_tokens(saved, tiny_tokenizer):
    info = read_snapshot_meta(saved.root)
    assert info is not None
    assert info.meta["chat_template"] == tiny_tokenizer.chat_template
    assert info.meta["special_tokens"]["bos_token"] == "<|im_start|>"
    assert info.meta["special_tokens"]["eos_token"] == "<|im_end|>"


@pytest.mark.parametrize("system", [SYSTEM, None])
@pytest.mark.parametrize("text", [KEPT, "tabs\tand\nnewlines, ünïcode ✓"])
def test_prompt_ids_equal_the_engines_without_transformers(saved, text, system):
    """jinja2 + tokenizer.json give the ids transformers' apply_chat_template + encode give."""
    info = read_snapshot_meta(saved.root)
    assert info is not None
    tok = SnapshotTokenizer.load(info.meta["tokenizer_file"])
    ours = prompt_ids(info.meta, PromptSpec.of_text(text, system, raw=False), tok)
    assert ours == saved.encode(text, system)


def test_diverged_where_one_word_changed(saved):
    doc = explain(saved.root, "--explain", CHANGED, "--system", SYSTEM)
    new_ids = saved.encode(CHANGED)
    parted = common_prefix(saved.ids[KEPT], new_ids)
    assert 0 < parted < len(new_ids) - 1
    assert doc["miss_reason"] == "diverged"
    assert doc["diverged_at"] == doc["cached_tokens"] == parted
    assert without_detail(doc) == saved.live(new_ids)
    detail = doc["detail"]
    assert detail["prompt_tokens"] == len(new_ids)
    assert detail["cached"].startswith("dog") and detail["new"].startswith("cat")
    assert detail["before"].endswith("lazy ")


def test_evicted_by_clear_past_what_the_kept_turn_shares(saved):
    doc = explain(saved.root, "--explain", EVICTED, "--system", SYSTEM)
    ids = saved.ids[EVICTED]
    assert doc["miss_reason"] == "evicted" and doc["evicted_by"] == "clear"
    # the kept turn re-cached the shared system prompt and user header, not the rest
    assert doc["cached_tokens"] == common_prefix(ids, saved.ids[KEPT]) > 0
    assert doc["evicted_through"] == len(ids)
    assert without_detail(doc) == saved.live(ids)
    assert doc["detail"]["evicted_tokens"] == len(ids) - doc["cached_tokens"]
    assert doc["detail"]["new"].startswith("Alpha")


def test_cold_when_nothing_was_cached(saved):
    doc = explain(saved.root, "--raw", "--explain", "zebra crossing")
    assert doc["miss_reason"] == "cold" and doc["cached_tokens"] == 0
    info = read_snapshot_meta(saved.root)
    assert info is not None
    raw = SnapshotTokenizer.load(info.meta["tokenizer_file"]).encode("zebra crossing")
    assert without_detail(doc) == saved.live(raw)
    assert doc["detail"]["templated"] is False


def test_the_kept_turn_is_a_hit(saved):
    doc = explain(saved.root, "--explain", KEPT, "--system", SYSTEM)
    assert doc["miss_reason"] == "hit"
    assert doc["cached_tokens"] == len(saved.ids[KEPT])  # its exact entry serves it all


def test_a_file_and_a_batch_row_explain_like_the_text(saved, tmp_path):
    plain = tmp_path / "prompt.txt"
    plain.write_text(CHANGED)
    row = tmp_path / "row.json"
    row.write_text(json.dumps({"messages": [{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": CHANGED}]}))
    want = explain(saved.root, "--explain", CHANGED, "--system", SYSTEM)
    assert explain(saved.root, "--explain-file", str(plain), "--system", SYSTEM) == want
    assert explain(saved.root, "--explain-file", str(row)) == want
    prompt_row = tmp_path / "prompt-row.json"
    prompt_row.write_text(json.dumps({"prompt": CHANGED, "system": SYSTEM}))
    assert explain(saved.root, "--explain-file", str(prompt_row)) == want


def test_a_jsonl_file_is_explained_line_by_line(saved, tmp_path):
    rows = tmp_path / "requests.jsonl"
    rows.write_text(json.dumps({"prompt": CHANGED, "system": SYSTEM}) + "\n\n"
                    + json.dumps({"prompt": KEPT, "system": SYSTEM}) + "\n")
    result = CliRunner().invoke(cli.app, ["inspect", "--sessions-dir", str(saved.root), "--json",
                                          "--explain-file", str(rows)], env=WIDE)
    assert result.exit_code == 0, result.output
    answers = [json.loads(x) for x in result.output.splitlines()]
    assert [a["line"] for a in answers] == [1, 3]  # one answer per request, not one message
    changed = explain(saved.root, "--explain", CHANGED, "--system", SYSTEM)
    kept = explain(saved.root, "--explain", KEPT, "--system", SYSTEM)
    assert [without_detail(a) for a in answers] == [
        {"line": 1, **without_detail(changed)}, {"line": 3, **without_detail(kept)}]
    text = CliRunner().invoke(cli.app, ["inspect", "--sessions-dir", str(saved.root),
                                        "--explain-file", str(rows)], env=WIDE).output
    assert "index.json · line 1" in text and "index.json · line 3" in text
    rows.write_text(rows.read_text() + "not json\n")
    bad = CliRunner().invoke(cli.app, ["inspect", "--sessions-dir", str(saved.root),
                                       "--explain-file", str(rows)], env=WIDE)
    assert bad.exit_code == 2 and "line 4 is not a batch row" in bad.output


def test_text_panel_shows_both_sides_of_the_divergence(saved):
    result = CliRunner().invoke(cli.app, ["inspect", "--sessions-dir", str(saved.root),
                                          "--explain", CHANGED, "--system", SYSTEM], env=WIDE)
    assert result.exit_code == 0, result.output
    parted = common_prefix(saved.ids[KEPT], saved.encode(CHANGED))
    n = len(saved.encode(CHANGED))
    assert f"diverged at token {parted} of {n}: cached 'he lazy dog near' vs new " \
           f"'he lazy cat near'" in result.output
    assert f"cached     {parted} / {n} tok" in result.output
    assert "…he lazy dog near" in result.output and "…he lazy cat near" in result.output


def test_explain_imports_neither_torch_nor_transformers(saved):
    code = (
        "import sys\n"
        f"sys.argv = ['kvchat', 'inspect', '--sessions-dir', {str(saved.root)!r}, "
        f"'--explain', {CHANGED!r}, '--system', {SYSTEM!r}]\n"
        "from kvchat import cli\n"
        "try:\n    cli.main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('HEAVY', sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "diverged at token" in out.stdout
    assert "HEAVY []" in out.stdout


def test_a_command_line_byte_that_is_not_utf8_is_refused_not_blamed_on_the_snapshot(
    saved, tmp_path
):
    args = [sys.executable, "-m", "kvchat", "inspect", "--sessions-dir", str(saved.root),
            "--explain"]
    out = subprocess.run([*args, b"hello \xff"], capture_output=True, timeout=120)
    err = " ".join(out.stderr.decode().split())
    assert out.returncode == 2, err
    assert "The --explain text is not valid Unicode: byte 0xff at character 7 is not UTF-8" in err
    assert "snapshot" not in err and "Traceback" not in err
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"caf\xe9")
    result = CliRunner().invoke(cli.app, ["inspect", "--sessions-dir", str(saved.root),
                                          "--explain-file", str(prompt)], env=WIDE)
    assert result.exit_code == 2
    assert "is not UTF-8 text (byte 4 is 0xe9)" in " ".join(result.output.split())


DROP = object()  # _copy_with: leave the key out, as an older kvchat's index does


def _copy_with(saved: Saved, tmp_path: Path, **changes: Any) -> Path:
    meta = json.loads((saved.root / "cache" / "index.json").read_text())
    meta.update(changes)
    for key in [k for k, v in changes.items() if v is DROP]:
        del meta[key]
    (tmp_path / "cache").mkdir(parents=True)
    (tmp_path / "cache" / "index.json").write_text(json.dumps(meta))
    return tmp_path


@pytest.mark.parametrize(
    ("changes", "args", "message"),
    [
        ({"tokenizer_file": None}, (), "records no tokenizer file"),
        ({"tokenizer_file": "/nonexistent/tokenizer.json"}, (),
         "/nonexistent/tokenizer.json, cannot be read"),
        ({"chat_template": None, "plain_start": DROP}, (), "run `kvchat chat`"),  # older
    ],
    ids=["no-tokenizer", "tokenizer-gone", "no-template"],
)
def test_what_is_missing_is_a_clear_error(saved, tmp_path, changes, args, message):
    root = _copy_with(saved, tmp_path, **changes)
    result = CliRunner().invoke(cli.app, ["inspect", "--sessions-dir", str(root), "--explain",
                                          "hi", *args], env=WIDE)
    assert result.exit_code == 2, result.output
    assert message in result.output.replace("\n", " ")
    assert "Traceback" not in result.output


def test_raw_needs_no_template(saved, tmp_path):
    root = _copy_with(saved, tmp_path, chat_template=None)
    assert explain(root, "--raw", "--explain", "zebra")["miss_reason"] == "cold"


def test_no_snapshot_and_misused_options(tmp_path):
    runner = CliRunner()
    result = runner.invoke(cli.app, ["inspect", "--sessions-dir", str(tmp_path), "--explain",
                                     "hi"], env=WIDE)
    assert result.exit_code == 1
    assert f"No cache snapshot in {tmp_path / 'cache'}" in result.output
    result = runner.invoke(cli.app, ["inspect", "--sessions-dir", str(tmp_path), "--raw"],
                           env=WIDE)
    assert result.exit_code == 2 and "go with one of --explain" in result.output
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prompt": "x", "colour": "red"}))
    result = runner.invoke(cli.app, ["inspect", "--sessions-dir", str(tmp_path),
                                     "--explain-file", str(bad)], env=WIDE)
    assert result.exit_code == 2 and 'not a batch row: unknown field "colour"' in result.output


RICH_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role') }}
    {% endif %}
    {% if message['role'] == 'system' %}
        {% continue %}
    {% endif %}
    <{{ message['role'] }}> {{ message['content'] | trim }} {{ eos_token }}
{% endfor %}
{% if messages[0]['role'] == 'system' %}sys={{ messages[0]['content'] | tojson }}{% endif %}
{% if add_generation_prompt %}<assistant>{% endif %}"""


@pytest.mark.parametrize("system", ["be <brief> & kind", None])
def test_render_chat_matches_transformers_on_a_template_with_blocks(tiny_tokenizer, system):
    """Whitespace control (trim_blocks, lstrip_blocks), loop controls, tojson without HTML
    escaping and the special tokens as variables, as apply_chat_template renders them."""
    from kvchat.inspect.explain import ExplainError, render_chat

    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "  hi\n"}, {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "again"}]
    want = tiny_tokenizer.apply_chat_template(messages, chat_template=RICH_TEMPLATE,
                                              tokenize=False, add_generation_prompt=True)
    special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    assert render_chat(RICH_TEMPLATE, special, messages) == want
    with pytest.raises(ExplainError, match="unknown role"):
        render_chat(RICH_TEMPLATE, special, [{"role": "tool", "content": "x"}])
